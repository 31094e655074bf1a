"""The step's estimated device memory (``minifield.models.device_memory``) against figures
computed by hand here, and against the chip's compiled peaks of Qwen2.5-0.5B's full
fine-tune (docs/tpu-session.json, the device check's ``shapes`` section)."""

from __future__ import annotations

import math

import pytest

from minifield.models import device_memory
from minifield.models.llama_config import LlamaConfig

QWEN_05B = LlamaConfig(
    vocab_size=151936, d_model=896, n_layers=24, n_heads=14, n_kv_heads=2, d_ff=4864,
    max_len=2048, qkv_bias=True, tie_embeddings=True,
)  # fmt: skip
LLAMA_8B = LlamaConfig(
    vocab_size=128256, d_model=4096, n_layers=32, n_heads=32, n_kv_heads=8, d_ff=14336,
    max_len=2048, rope_theta=500000.0,
)  # fmt: skip
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def recipe(rows, lora=None, **training):
    model = {"scan_layers": True, **({"lora": lora} if lora else {})}
    settings = {"batch_size": rows, "seq_len": 2048, "remat": "full", "loss_chunk_tokens": 1024}
    return {"model": model, "training": {**settings, **training}}


# Qwen2.5-0.5B: 494,032,768 parameters (the chip's count of the trained state), 18 bytes each
QWEN_STATE = 18 * 494_032_768
QWEN_ROW = (
    24 * 2048 * 896 * 4  # each layer's input kept (remat full)
    + math.ceil(1.5 * 2048 * 4 * (8 * 896 + 4 * 4864))  # one and a half working sets
    + 4 * 14 * 2048 * 2048 * 4  # its attention scores, probabilities and their gradients
)
QWEN_LOGITS = 3 * 4 * 151936 * 1024


@pytest.mark.parametrize(
    ("rows", "measured"),
    # compiled peaks on the TPU v5e (2b16d3e): the program's arguments + outputs + temporaries
    [(1, 10_282_210_304), (2, 12_156_869_120), (4, 13_795_308_544), (5, 15_575_699_968),
     (6, 16_530_033_152), (7, 17_537_521_152)],
)  # fmt: skip
def test_full_fine_tuning_is_the_hand_figure_and_above_the_chips_peak(rows, measured):
    parts = device_memory.estimate(QWEN_05B, recipe(rows))
    assert parts == {
        "state": QWEN_STATE,
        "activations": rows * QWEN_ROW,
        "logits": QWEN_LOGITS,
        "total": QWEN_STATE + rows * QWEN_ROW + QWEN_LOGITS,
    }
    assert parts["total"] >= measured


def test_gradient_accumulation_counts_the_micro_batch_and_the_accumulator():
    parts = device_memory.estimate(QWEN_05B, recipe(6, grad_accum_steps=3))
    assert parts["state"] == (18 + 11) * 494_032_768 and parts["activations"] == 2 * QWEN_ROW


def test_no_chunks_no_remat_no_xla_attention():
    cfg = LlamaConfig(vocab_size=100, d_model=8, n_layers=3, n_heads=2, n_kv_heads=1, d_ff=16,
                      max_len=4)  # fmt: skip
    r = {"model": {"attention": "pallas"}, "training": {"batch_size": 2, "seq_len": 4}}
    parts = device_memory.estimate(cfg, r)
    # every layer's working set, 1.6 times (remat none)
    assert parts["activations"] == 2 * 3 * math.ceil(1.6 * 4 * 4 * (8 * 8 + 4 * 16))
    assert parts["logits"] == 3 * 4 * 100 * 8  # every token's logits


# Llama-3.1-8B: per layer q 4096², k and v 4096 x 1024, o 4096², gate, up, down 4096 x 14336
LAYER_MATRICES = 2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 14336  # 218,103,808
LLAMA_REST = 2 * 128256 * 4096 + 32 * 2 * 4096 + 4096  # embeddings, head, norms
ADAPTERS = 32 * 16 * (2 * 8192 + 2 * 5120 + 3 * 18432)  # rank 16 x (in + out), 7 per layer
LLAMA_ACTIVATIONS = (
    32 * 2048 * 4096 * 4 + 3 * 2048 * 2 * (8 * 4096 + 4 * 14336) + 4 * 32 * 2048 * 2048 * 4
)
LLAMA_LOGITS = 3 * 4 * 128256 * 1024


def test_an_nf4_8b_base_at_one_row_is_the_hand_figure_and_fits_a_v5e():
    lora = {"rank": 16, "targets": ALL, "base_dtype": "bfloat16", "base_quantization": "nf4",
            "quantization_block": 64}  # fmt: skip
    parts = device_memory.estimate(LLAMA_8B, recipe(1, lora))
    codes = 32 * LAYER_MATRICES // 2
    scales = 32 * LAYER_MATRICES // 64 * 4
    made_back = 2 * LAYER_MATRICES * 2  # one layer's, forward and backward, in BF16
    # no copy of the [out, in] head: a scanned run's is transposed once, as placed
    state = codes + scales + 2 * LLAMA_REST + made_back + 18 * ADAPTERS
    assert parts["state"] == state == 7_655_137_280
    total = state + LLAMA_ACTIVATIONS + LLAMA_LOGITS
    assert parts["total"] == total == 13_559_668_736
    v5e = {**recipe(1, lora), "runtime": {"device_memory_bytes": 16_909_336_064}}
    assert device_memory.problem(LLAMA_8B, v5e) is None


def test_a_bf16_8b_base_is_refused_on_a_v5e_naming_the_key_and_the_figure():
    lora = {"rank": 16, "targets": ALL, "base_dtype": "bfloat16"}
    r = {**recipe(1, lora), "runtime": {"device_memory_bytes": 16_909_336_064}}
    # held in BF16 (scanned: the blocks stacked and every [out, in] matrix, the head's too,
    # transposed once as placed: no copy in the step)
    state = 2 * 32 * LAYER_MATRICES + 2 * LLAMA_REST + 18 * ADAPTERS
    total = state + LLAMA_ACTIVATIONS + LLAMA_LOGITS
    assert total == 22_720_028_672
    problem = device_memory.problem(LLAMA_8B, r)
    assert problem.startswith(
        "the step needs an estimated 22.72 GB (state 16.82, activations 4.33, logits 1.58) for "
        "1 row of 2048 tokens, above runtime.device_memory_bytes 16.91 GB; "
    )
    assert "\n" not in problem


def test_double_quantization_holds_the_scales_in_a_byte():
    # 256 inputs x 64 outputs in blocks of 64: 16,384 codes... as bytes: 8192 (two a byte);
    # 4 x 64 = 256 scales: one byte each, one group of 256 (its FP32 absmax) and the FP32 mean
    assert device_memory.held_bytes((256, 64), "nf4", 64, True, "bfloat16") == 8192 + 256 + 4 + 4
    assert device_memory.held_bytes((256, 64), "nf4", 64, False, "bfloat16") == 8192 + 4 * 256
    assert device_memory.held_bytes((256, 64), "int8", None, False, "bfloat16") == 16384 + 4 * 64
    assert device_memory.held_bytes((256, 64), None, None, False, "bfloat16") == 2 * 16384


#: the device check's 125M and 350M full fine-tuning steps (d_model, layers, heads, d_ff; a
#: 32,000-token vocabulary), 2048 tokens a row, splash, chunks of 1024, BF16 compute
CHECK_STEPS = {"125m": (768, 12, 12, 1792), "350m": (1024, 24, 16, 2560)}
#: (size, remat, rows a micro-batch, micro-batches) -> the compiler's peak for a TPU v5e
#: (arguments + outputs + temporaries - aliased; benchmarks/tpu_compile.py step, 2026-12-06,
#: libtpu 0.0.42.1: docs/tpu.md), None where it refused the program (out of HBM)
COMPILED_PEAKS = {
    ("125m", "full", 4, 1): 2_871_868_928, ("125m", "full", 8, 1): 3_858_838_016,
    ("125m", "full", 16, 1): 5_700_798_976, ("125m", "full", 32, 1): 9_009_413_632,
    ("125m", "none", 2, 1): 6_282_760_192, ("125m", "none", 4, 1): 10_411_012_608,
    ("125m", "none", 4, 4): 11_833_693_696, ("125m", "none", 2, 8): 7_641_191_936,
    ("125m", "none", 8, 1): None,
    ("125m", "dots_saveable", 4, 1): 5_475_111_424, ("125m", "dots_saveable", 8, 1): 8_789_522_432,
    ("125m", "dots_saveable", 16, 1): 15_235_121_152, ("125m", "dots_saveable", 8, 2): 9_955_934_720,
    ("125m", "dots_saveable", 4, 4): 6_591_566_336,
    ("125m", "save_attention", 4, 1): 4_507_532_800, ("125m", "save_attention", 8, 1): 6_602_075_136,
    ("125m", "save_attention", 16, 1): 11_367_695_360,
    ("350m", "full", 2, 1): 7_186_265_600, ("350m", "full", 4, 1): 8_459_019_776,
    ("350m", "full", 8, 1): 9_988_174_848, ("350m", "offload_attention", 8, 1): 9_985_844_736,
    ("350m", "none", 1, 1): 12_124_187_648, ("350m", "none", 1, 8): 16_123_838_976,
    ("350m", "none", 2, 1): None,
    ("350m", "dots_saveable", 1, 1): 9_027_774_464, ("350m", "dots_saveable", 2, 1): 10_877_934_592,
    ("350m", "dots_saveable", 4, 1): 14_701_045_760, ("350m", "dots_saveable", 2, 4): 13_850_501_120,
    ("350m", "dots_saveable", 4, 2): None, ("350m", "dots_saveable", 8, 1): None,
    ("350m", "save_attention", 2, 1): 9_414_898_176, ("350m", "save_attention", 4, 1): 11_650_588_672,
    ("350m", "save_attention", 8, 1): 16_210_002_432, ("350m", "save_attention", 4, 2): 14_623_540_736,
}  # fmt: skip
V5E_BYTES_LIMIT = 16_909_336_064


def check_step(size: str) -> LlamaConfig:
    d_model, layers, heads, d_ff = CHECK_STEPS[size]
    return LlamaConfig(vocab_size=32000, d_model=d_model, n_layers=layers, n_heads=heads,
                       n_kv_heads=heads, d_ff=d_ff, max_len=2048)  # fmt: skip


def step_recipe(rows: int, remat: str, micro_batches: int = 1, seq_len: int = 2048) -> dict:
    """The device check's step as a recipe: ``rows`` in all, splash, chunks of 1024."""
    return {"model": {"attention": "pallas"},
            "training": {"batch_size": rows, "grad_accum_steps": micro_batches,
                         "seq_len": seq_len, "remat": remat, "loss_chunk_tokens": 1024}}  # fmt: skip


@pytest.mark.parametrize(("step", "peak"), COMPILED_PEAKS.items(), ids=lambda v: str(v))
def test_each_remat_policy_is_estimated_above_the_compilers_peak(step, peak):
    """Above the compiled peak wherever the compiler fits the step, above the chip's memory
    wherever it refuses it: the refusal never admits a step the chip cannot hold."""
    size, remat, rows, micro_batches = step
    r = step_recipe(rows * micro_batches, remat, micro_batches)
    total = device_memory.estimate(check_step(size), r)["total"]
    assert total >= (V5E_BYTES_LIMIT if peak is None else peak)


@pytest.mark.parametrize(("size", "rows"), [("350m", 8), ("125m", 16)])
def test_auto_runs_the_fewest_micro_batches_the_compiler_fits(size, rows):
    """``remat: auto`` at the device check's steps: ``dots_saveable`` in the fewest
    micro-batches whose step the compiler fitted on the v5e (:data:`COMPILED_PEAKS`, the
    chip compiler's figures, not the estimate's): at 350M 4 of 2 rows, where 1 of 8 and 2 of
    4 did not compile; at 125M the 16 rows at once."""
    found = device_memory.plan(check_step(size), step_recipe(rows, "auto"))
    splits = [k for k in (1, 2, 4, 8) if (size, "dots_saveable", rows // k, k) in COMPILED_PEAKS]
    fitting = [k for k in splits if COMPILED_PEAKS[(size, "dots_saveable", rows // k, k)]]
    assert found.remat == "dots_saveable" and found.grad_accum_steps == min(fitting)
    assert all(COMPILED_PEAKS[(size, "dots_saveable", rows // k, k)] is None
               for k in splits if k < found.grad_accum_steps)  # fmt: skip
    peak = COMPILED_PEAKS[(size, "dots_saveable", rows // found.grad_accum_steps,
                           found.grad_accum_steps)]  # fmt: skip
    assert peak <= found.estimated_bytes <= device_memory.AUTO_DEVICE_BYTES == V5E_BYTES_LIMIT
    assert found.grad_accum_steps == {"350m": 4, "125m": 1}[size]


def test_auto_takes_the_recipes_micro_batches_as_its_fewest():
    found = device_memory.plan(check_step("125m"), step_recipe(16, "auto", micro_batches=2))
    assert (found.remat, found.grad_accum_steps) == ("dots_saveable", 2)
    spelled = device_memory.estimate(check_step("125m"), step_recipe(16, "dots_saveable", 2))
    assert found.estimated_bytes == spelled["total"]


def test_auto_keeps_a_micro_batch_it_adds_at_2048_tokens_or_more():
    """A deep narrow model (d 768, 64 layers) at 8 rows of 512 tokens: ``dots_saveable``
    would fit only in micro-batches under 2048 tokens (measured on the chip down to one row of
    2048), so ``auto`` falls back to ``full`` at the recipe's one micro-batch."""
    cfg = LlamaConfig(vocab_size=32000, d_model=768, n_layers=64, n_heads=12, n_kv_heads=12,
                      d_ff=2048, max_len=512)  # fmt: skip
    found = device_memory.plan(cfg, step_recipe(8, "auto", seq_len=512))
    assert (found.remat, found.grad_accum_steps) == ("full", 1)
    assert (
        found.estimated_bytes
        == device_memory.estimate(cfg, step_recipe(8, "full", 1, 512))["total"]
    )

    def dots_fits(k: int) -> bool:
        total = device_memory.estimate(cfg, step_recipe(8, "dots_saveable", k, 512))["total"]
        return total <= V5E_BYTES_LIMIT

    assert not any(dots_fits(k) for k in (1, 2))  # 4096 and 2048 tokens a micro-batch
    assert dots_fits(8)  # one row of 512 tokens: under the floor


def test_a_named_policy_is_the_recipes_plan():
    found = device_memory.plan(check_step("350m"), step_recipe(8, "save_attention", 2))
    assert found == device_memory.Plan("save_attention", 2, None)


def test_auto_sizes_a_devices_share_of_the_rows():
    """On a mesh each device holds its share: 350M's 16 rows over 2 devices are 8 a device,
    4 micro-batches of 2 (each micro-batch's 4 rows split over the devices)."""
    r = step_recipe(16, "auto")
    r["training"]["data_parallel"] = {"devices": 2}
    found = device_memory.plan(check_step("350m"), r)
    assert (found.remat, found.grad_accum_steps) == ("dots_saveable", 4)


def test_auto_keeps_lora_at_full():
    """LoRA's estimate is not calibrated for ``dots_saveable``: a Llama-3.2-3B NF4 LoRA step
    (rank 16, every projection, one row of 2048, splash) compiled for the chip to
    16,451,092,992 bytes with it (``tpu_compile.py qlora --preset llama-3.2-3b --mode nf4
    --remat dots_saveable --attention splash``, 2026-12-07), above what the estimate says:
    ``auto`` keeps a LoRA step at ``full``, the policy its estimate was checked against, at
    the recipe's micro-batches."""
    cfg = LlamaConfig(vocab_size=128256, d_model=3072, n_layers=28, n_heads=24, n_kv_heads=8,
                      d_ff=8192, max_len=2048, rope_theta=500000.0, tie_embeddings=True)  # fmt: skip
    lora = {"rank": 16, "targets": ALL, "base_dtype": "bfloat16", "base_quantization": "nf4",
            "quantization_block": 64}  # fmt: skip
    r = {"model": {"scan_layers": True, "attention": "pallas", "lora": lora},
         "training": {"batch_size": 1, "seq_len": 2048, "remat": "auto",
                      "loss_chunk_tokens": 1024}}  # fmt: skip
    dots = device_memory.with_plan(r, device_memory.Plan("dots_saveable", 1))
    assert device_memory.estimate(cfg, dots)["total"] < 16_451_092_992  # under the compiler
    full = device_memory.estimate(cfg, device_memory.with_plan(r, device_memory.Plan("full", 1)))
    assert device_memory.plan(cfg, r) == device_memory.Plan("full", 1, full["total"])
