"""Execution options of the packed-SFT model: fused attention, remat, scanned layers, chunked
cross-entropy. Each is checked against the default path (the reference) or by hand, on tiny
shapes; the fused kernel runs in Pallas's interpreter on CPU."""

from __future__ import annotations

import copy
import dataclasses
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import fusion_emitters_turned_off

from minifield import recipe as recipes
from minifield.data.packing import Rows
from minifield.models import model
from minifield.models.execution import Execution
from minifield.models.layers import attention, layer_stack
from minifield.models.llama import LlamaConfig
from minifield.state.arrays import named_arrays, restore_like, state_hash
from minifield.training.optimizer import make_optimizer
from minifield.training.train_step import init_train_state, make_train_step

REPO = Path(__file__).resolve().parents[1]
V = 37


def gpt(**overrides):
    base = dict(vocab_size=V, d_model=16, n_layers=2, n_heads=2, d_ff=32, max_len=32)
    base.update(compute_dtype="float32", positions="rotary", tie_embeddings=False)
    base.update(overrides)
    return model.ModelConfig(**base)


def llama(**overrides):
    base = dict(vocab_size=V, d_model=16, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=32)
    base.update(max_len=32, compute_dtype="float32", qkv_bias=True)
    base.update(overrides)
    return LlamaConfig(**base)


def with_execution(cfg, **options):
    return dataclasses.replace(cfg, execution=Execution(**options))


def packed_batch(B=2, T=16, seed=0, lengths=(3, 8, 3)):
    """Rows of segments of the given lengths (positions restart), padding after them."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(1, V, (B, T)).astype(np.int32)
    segments, positions = np.zeros((B, T), np.int32), np.zeros((B, T), np.int32)
    for b in range(B):
        at = 0
        for s, n in enumerate(lengths, start=1):
            segments[b, at : at + n] = s
            positions[b, at : at + n] = np.arange(n)
            at += n
    loss_mask = (rng.random((B, T)) < 0.8).astype(np.float32)
    return jax.tree_util.tree_map(jnp.asarray, Rows(tokens, segments, positions, loss_mask))


def loss_and_grads(cfg, params, batch, **compiler_options):
    step = jax.value_and_grad(lambda p: model.loss_fn(p, cfg, batch)[0])
    return jax.jit(step, compiler_options=compiler_options or None)(params)


def assert_trees_close(a, b, rtol, atol):
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=atol)


def assert_leaves_within(a, b, relative):
    """Each leaf of ``a`` within ``relative`` of ``b``'s norm (BF16 noise is per element
    large where the value is small; its size against the whole gradient is what is bounded)."""
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b), strict=True):
        x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
        assert np.linalg.norm(x - y) <= relative * np.linalg.norm(y)


def assert_trees_equal(a, b):
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


# ----------------------------------------------------------------------------- fused attention


def _kernel_inputs(dtype, B=2, T=16, H=4, G=2, K=8):
    keys = jax.random.split(jax.random.key(3), 4)
    q = jax.random.normal(keys[0], (B, T, H, K), jnp.float32).astype(dtype)
    k = jax.random.normal(keys[1], (B, T, G, K), jnp.float32).astype(dtype)
    v = jax.random.normal(keys[2], (B, T, G, K), jnp.float32).astype(dtype)
    # row 0: segments 1|2|3 with boundaries at 3 and 11 (inside the 8- and 4-token blocks),
    # then padding; row 1: one long segment crossing every block, then a short one
    segments = np.zeros((B, T), np.int32)
    segments[0, :3], segments[0, 3:11], segments[0, 11:14] = 1, 2, 3
    segments[1, :13], segments[1, 13:] = 1, 2
    return q, k, v, jnp.asarray(segments), jax.random.normal(keys[3], (B, T, H * K))


#: the fused kernel here is the GPU (Triton) one, run in Pallas's interpreter on CPU; a TPU
#: cannot run it (a TPU recipe's pallas is splash attention: tests/test_tpu_attention.py)
KERNEL_RUNS_HERE = pytest.mark.skipif(
    "jax.default_backend() == 'tpu'", reason="the fused attention kernel is GPU-only"
)


@pytest.mark.slow  # ~10 s of compiling on CI; the fast tier keeps the fused model tests below
@KERNEL_RUNS_HERE
def test_fused_attention_matches_the_xla_path_forward_and_backward():
    """FP32 inputs (a tight bound), 8-token forward and 4-token backward blocks, so segment
    boundaries fall inside blocks and a segment spans several; grouped-query heads."""
    from jax.experimental.pallas.ops.gpu.attention import BlockSizes

    cfg = llama()
    q, k, v, segments, cotangent = _kernel_inputs(cfg.dtype)
    blocks = BlockSizes(8, 8, block_q_dkv=4, block_kv_dkv=4, block_q_dq=4, block_kv_dq=4)
    mask = attention.segment_mask(segments)

    def xla(q, k, v):
        return attention.xla_mix(cfg, q, k, v, mask)

    def fused(q, k, v):
        return attention.pallas_mix(cfg, q, k, v, segments, blocks)

    @jax.jit
    def out_and_grads(q, k, v):
        results = []
        for fn in (xla, fused):
            out, vjp = jax.vjp(fn, q, k, v)
            results.append((out, vjp(cotangent)))
        return results

    (out_x, grads_x), (out_f, grads_f) = out_and_grads(q, k, v)
    np.testing.assert_allclose(out_f, out_x, rtol=1e-5, atol=1e-5)
    for g_f, g_x in zip(grads_f, grads_x, strict=True):
        assert g_f.shape == g_x.shape
        np.testing.assert_allclose(g_f, g_x, rtol=1e-5, atol=1e-5)


# 25-40 s of compiling on this machine: in the slow tier, so the fast tier stays a quick loop
@pytest.mark.slow
@KERNEL_RUNS_HERE
def test_fused_attention_model_loss_and_gradients_match_the_xla_path_in_bf16():
    """Within BF16 noise: the XLA path's own BF16 gradients differ from its FP32 ones by 0.4 to
    2.6 % (per-leaf norm) on this model; the fused kernel's differ from them by at most 1.2 %."""
    cfg = llama(compute_dtype="bfloat16", n_layers=1)
    params = model.init_params(cfg, jax.random.key(0))
    batch = packed_batch()
    loss_x, grads_x = loss_and_grads(cfg, params, batch)
    loss_f, grads_f = loss_and_grads(with_execution(cfg, attention="pallas"), params, batch)
    np.testing.assert_allclose(float(loss_f), float(loss_x), rtol=1e-2)
    assert_leaves_within(grads_f, grads_x, 0.03)


@pytest.mark.slow  # compile-heavy for the fast tier (6 CPU-s there); the full suite runs it; fused generation stays fast
@KERNEL_RUNS_HERE
def test_fused_attention_sees_each_packed_example_as_if_alone():
    """Positions restart per segment and no query reads another segment: every example's
    per-token losses in a packed row equal those of the example alone in its own row."""
    cfg = with_execution(gpt(n_layers=1), attention="pallas")
    params = model.init_params(cfg, jax.random.key(1))
    packed = packed_batch(B=1, lengths=(5, 6, 4))
    losses = jax.jit(model.token_losses, static_argnums=(1,))(params, cfg, packed)
    at = 0
    for n in (5, 6, 4):
        # built in NumPy: op by op, each slice length compiled its own scatter per array
        alone = Rows._make(np.zeros_like(v) for v in packed)
        alone.tokens[0, :n] = np.asarray(packed.tokens)[0, at : at + n]
        alone.segments[0, :n] = 1
        alone.positions[0, :n] = np.arange(n)
        alone_losses = jax.jit(model.token_losses, static_argnums=(1,))(params, cfg, alone)
        # the last token of an example predicts the next segment's first token: not compared
        np.testing.assert_allclose(losses[0, at : at + n - 1], alone_losses[0, : n - 1], 1e-5)
        at += n


def test_fused_attention_refuses_rows_that_are_not_whole_blocks():
    cfg = llama()
    q = jnp.zeros((1, 48, 4, 4), jnp.float32)
    kv = jnp.zeros((1, 48, 2, 4), jnp.float32)
    with pytest.raises(ValueError, match="training.seq_len must be .* multiple of 32 .*got 48"):
        attention.pallas_mix(cfg, q, kv, kv, jnp.ones((1, 48), jnp.int32))


# ----------------------------------------------------------------------------- remat and scan

# One FP32 reference (the default execution) per family, compiled once for the module: the
# GPT block with untied head, the Llama block (grouped-query, q/k/v biases) with tied head.
# Compiled with XLA:CPU's fusion emitters, as production compiles: the fast tier turns them off
# where the jaxlib still has the switch (tests/conftest.py), and remat is bit for bit the default under them (the test below asks for
# them too); the other comparisons hold within a tolerance either way.
FUSION_EMITTERS = {"xla_cpu_use_fusion_emitters": True} if fusion_emitters_turned_off() else {}
FAMILIES = {"gpt": lambda: gpt(), "llama": lambda: llama(tie_embeddings=True)}


@pytest.fixture(scope="module")
def reference():
    cache = {}

    def get(family):
        if family not in cache:
            cfg = FAMILIES[family]()
            params = model.init_params(cfg, jax.random.key(0))
            batch = packed_batch()
            cache[family] = (
                cfg,
                params,
                batch,
                *loss_and_grads(cfg, params, batch, **FUSION_EMITTERS),
            )
        return cache[family]

    return get


# "full" compiles for ~7 s on CI: in the slow tier; the fast tier keeps "dots_saveable"
# ("save_attention", the names a policy keeps, in the slow tier: the 3.12 fast tier's 90 s)
@pytest.mark.parametrize(
    "policy",
    [
        pytest.param("full", marks=pytest.mark.slow),
        pytest.param("dots_saveable", marks=pytest.mark.slow),
        pytest.param("save_attention", marks=pytest.mark.slow),
        pytest.param("offload_attention", marks=pytest.mark.slow),
    ],
)
def test_remat_gives_exactly_the_default_loss_and_gradients(reference, policy):
    cfg, params, batch, loss, grads = reference("llama")
    remat = with_execution(cfg, remat=policy)
    loss_r, grads_r = loss_and_grads(remat, params, batch, **FUSION_EMITTERS)
    assert float(loss_r) == float(loss)
    assert_trees_equal(grads_r, grads)


# gpt compiles for ~9 s on CI, llama ~4 s: both in the slow tier (the fast tier's scanned
# stacks: test_quantized_base's and test_moe_lora's scanned runs)
@pytest.mark.slow
@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_scanned_layers_give_the_default_loss_and_gradients(reference, family):
    """Also the order: the layers' parameters differ, so a scan that walked them in another
    order than 00, 01 would compute another function."""
    cfg, params, batch, loss, grads = reference(family)
    loss_s, grads_s = loss_and_grads(with_execution(cfg, scan_layers=True), params, batch)
    np.testing.assert_allclose(float(loss_s), float(loss), rtol=1e-6)
    # the gradient keeps the per-layer layout of the parameters
    assert jax.tree_util.tree_structure(grads_s) == jax.tree_util.tree_structure(params)
    assert_trees_close(grads_s, grads, rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------- scanned update

# Weight decay large enough that decaying a LayerNorm/bias leaf by mistake (a stacked [L, D]
# vector looks like a matrix) moves it by lr * wd = 5e-3 per update, far outside the tolerance;
# a learning rate high enough that clipping is active (grad norm > 1 at initialisation).
SCAN_TRAINING = {"learning_rate": 1e-2, "warmup_steps": 1, "weight_decay": 0.5}


@pytest.mark.slow  # three updates of two states compile for > 10 s on CI; the fast tier keeps
# the scanned loss and gradients above and the program size below
@pytest.mark.parametrize("family", FAMILIES)
def test_scanned_update_holds_stacked_layers_and_matches_the_looped_update(family):
    """The reference is the default per-layer loop: three updates of the scanned (stacked)
    state and of the looped one give the same parameters and AdamW moments, per element."""
    cfg = FAMILIES[family]()
    tx = make_optimizer(SCAN_TRAINING, 10)
    scanned_cfg = with_execution(cfg, scan_layers=True)
    looped = init_train_state(cfg, tx, seed=0)
    scanned = init_train_state(scanned_cfg, tx, seed=0)
    names = named_arrays(scanned)
    # the state holds the blocks stacked, in the parameters and in both AdamW moments
    assert not any("blocks/00" in name for name in names)
    wo = [name for name in names if name.endswith("blocks/stacked/attn/wo")]
    assert len(wo) == 3 and all(names[n].shape[0] == cfg.n_layers for n in wo), sorted(names)
    assert_trees_equal(layer_stack.per_layer(scanned), looped)  # the same initial values
    loop_step, scan_step = (
        jax.jit(make_train_step(cfg, tx)),
        jax.jit(make_train_step(scanned_cfg, tx)),
    )
    for seed in range(3):
        looped, loop_metrics = loop_step(looped, packed_batch(seed=seed))
        scanned, scan_metrics = scan_step(scanned, packed_batch(seed=seed))
        assert float(loop_metrics["grad_norm"]) > 1.0  # clipping is at work
        np.testing.assert_allclose(scan_metrics["grad_norm"], loop_metrics["grad_norm"], rtol=1e-5)
    per_layer = layer_stack.per_layer(scanned)
    assert jax.tree_util.tree_structure(per_layer) == jax.tree_util.tree_structure(looped)
    assert_trees_close(per_layer, looped, rtol=1e-4, atol=1e-6)


def _operations(text: str) -> list[str]:
    return sorted(re.findall(r"= (?:stablehlo|chlo|mhlo|func)\.[a-z_]+", text))


@pytest.mark.slow  # compile-heavy for the fast tier (4 CPU-s there); the full suite runs it; scanned losses stay fast
def test_the_scanned_update_program_does_not_grow_with_depth():
    """What makes its compile time independent of depth: the lowered update of a 2-layer and
    of a 5-layer model hold the same operations (only the layer axis's size differs); the
    looped update grows with each layer."""

    def operations(layers, scan):
        cfg = with_execution(gpt(n_layers=layers), scan_layers=scan)
        tx = make_optimizer(SCAN_TRAINING, 10)
        state = jax.eval_shape(lambda: init_train_state(cfg, tx, seed=0))
        return _operations(jax.jit(make_train_step(cfg, tx)).lower(state, packed_batch()).as_text())

    assert operations(2, scan=True) == operations(5, scan=True)
    assert len(operations(5, scan=False)) > len(operations(2, scan=False)) + 100


# ----------------------------------------------------------------------------- chunked loss


# gpt as for the scanned layers above: in the slow tier; the fast tier keeps llama
@pytest.mark.parametrize("family", [pytest.param("gpt", marks=pytest.mark.slow), "llama"])
def test_chunked_loss_gives_the_default_loss_and_gradients(reference, family):
    cfg, params, batch, loss, grads = reference(family)
    chunked = with_execution(cfg, loss_chunk_tokens=7)  # 32 tokens: 5 chunks, the last padded
    loss_c, grads_c = loss_and_grads(chunked, params, batch)
    np.testing.assert_allclose(float(loss_c), float(loss), rtol=1e-6)
    assert_trees_close(grads_c, grads, rtol=1e-5, atol=1e-6)


def test_chunked_loss_never_forms_the_whole_batch_of_logits():
    """The lowered gradient program holds no [B, T, V] (or [B*T, V]) FP32 array with chunks,
    only [C, V] ones; without them it holds [B, T, V] logits."""
    cfg = gpt(vocab_size=101)
    params = jax.eval_shape(lambda: model.init_params(cfg, jax.random.key(0)))
    batch = packed_batch()

    def lowered(c):
        return jax.jit(jax.grad(lambda p: model.loss_fn(p, c, batch)[0])).lower(params).as_text()

    assert "tensor<2x16x101xf32>" in lowered(cfg)
    text = lowered(with_execution(cfg, loss_chunk_tokens=8))
    assert "tensor<2x16x101xf32>" not in text and "tensor<32x101xf32>" not in text
    assert "tensor<8x101xf32>" in text


# ----------------------------------------------------------------------------- training


@pytest.mark.slow  # ~8 s of compiling on CI; each option alone is in the fast tier above
def test_training_with_every_option_is_reproducible_and_resumes_bit_identically():
    # (the fused kernel is left out: on CPU it runs in Pallas's interpreter, which says
    # nothing about the GPU kernel's bits)
    cfg = with_execution(
        llama(compute_dtype="bfloat16", n_layers=2),
        scan_layers=True,
        remat="dots_saveable",
        loss_chunk_tokens=12,
    )
    training = {"learning_rate": 1e-2, "warmup_steps": 1, "decay": "cosine"}
    training.update(min_learning_rate_ratio=0.1, weight_decay=0.01, b1=0.9, b2=0.99)
    training.update(eps=1e-8, grad_clip_norm=1.0)
    tx = make_optimizer(training, 10)
    step = jax.jit(make_train_step(cfg, tx))
    batches = [packed_batch(seed=s) for s in range(3)]

    def run(state, steps):
        for b in steps:
            state, _ = step(state, batches[b])
        return state

    first = run(init_train_state(cfg, tx, seed=0), [0, 1, 2])
    second = run(init_train_state(cfg, tx, seed=0), [0, 1, 2])
    assert state_hash(first) == state_hash(second)
    halfway = run(init_train_state(cfg, tx, seed=0), [0])
    template = jax.tree_util.tree_map(np.array, halfway)
    resumed = run(restore_like(template, named_arrays(halfway)), [1, 2])
    assert state_hash(resumed) == state_hash(first)


@pytest.mark.slow  # compiles generation twice (~2 s under 3.12)
def test_generation_of_a_fused_attention_model_equals_the_default():
    cfg = gpt(n_layers=1)
    params = model.init_params(cfg, jax.random.key(0))
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8]]
    expected = model.greedy_generate_batch(params, cfg, prompts, 6, None)
    fused = with_execution(cfg, attention="pallas", scan_layers=True, loss_chunk_tokens=4)
    assert model.greedy_generate_batch(params, fused, prompts, 6, None) == expected


def test_execution_options_are_not_part_of_the_exported_config():
    for cfg in (gpt(), llama()):
        options = with_execution(cfg, attention="pallas", scan_layers=True)
        assert options.to_dict() == cfg.to_dict()
        assert "execution" not in cfg.to_dict()
        assert model.config_from_dict(options.to_dict()) == cfg


# ----------------------------------------------------------------------------- recipes


def _demo() -> dict:
    return recipes.read_document(REPO / "config" / "recipes" / "sft-demo.yaml")


def _digest(document: dict) -> str:
    return recipes.validate(copy.deepcopy(document), "sft-demo.yaml").computation_digest


def test_spelled_out_defaults_keep_the_digest_and_other_values_change_it():
    demo = _demo()
    plain = _digest(demo)
    spelled = copy.deepcopy(demo)
    spelled["model"].update(attention="xla", scan_layers=False)
    spelled["training"].update(remat="none", loss_chunk_tokens=0)
    assert _digest(spelled) == plain
    changed = set()
    for section, key, value in [
        ("model", "attention", "pallas"),
        ("model", "scan_layers", True),
        ("training", "remat", "full"),
        ("training", "remat", "dots_saveable"),
        ("training", "loss_chunk_tokens", 256),
    ]:
        document = copy.deepcopy(demo)
        document[section][key] = value
        changed.add(_digest(document))
    assert plain not in changed and len(changed) == 5


def test_recipe_selects_the_execution_options():
    from minifield.models.execution import Execution as E

    document = _demo()
    document["model"].update(attention="pallas", scan_layers=True)
    document["training"].update(remat="full", loss_chunk_tokens=64)
    data = recipes.validate(document, "sft-demo.yaml").data
    assert E.from_recipe(data) == E("pallas", True, "full", 64)
    assert E.from_recipe(recipes.validate(_demo(), "x").data) == E()


@pytest.mark.parametrize(
    "section, key, value, path",
    [
        ("model", "attention", "cudnn", "/model/attention"),
        ("training", "remat", "some", "/training/remat"),
        ("training", "loss_chunk_tokens", -1, "/training/loss_chunk_tokens"),
        ("model", "scan_layers", "yes", "/model/scan_layers"),
    ],
)
def test_bad_execution_options_are_named(section, key, value, path):
    document = _demo()
    document[section][key] = value
    with pytest.raises(recipes.RecipeError) as info:
        recipes.validate(document, "sft-demo.yaml")
    assert [e["path"] for e in info.value.errors] == [path]


def test_fused_attention_recipe_needs_whole_blocks():
    document = _demo()
    document["model"]["attention"] = "pallas"
    document["training"]["seq_len"] = 48
    with pytest.raises(recipes.RecipeError) as info:
        recipes.validate(document, "sft-demo.yaml")
    (error,) = info.value.errors
    assert error["path"] == "/model/attention"
    assert "multiple of 32" in error["message"] and "got 48" in error["message"]
    document["training"]["seq_len"] = 96
    recipes.validate(document, "sft-demo.yaml")


@pytest.mark.slow  # ~9 s of compiling on CI; scanning and LoRA alone are in the fast tier
def test_scanned_layers_carry_lora_adapters():
    """LoRA's adapted weights (a pytree per target matrix) stack and scan like plain ones:
    the adapters' gradient is the loop's."""
    from minifield.training import lora

    cfg = llama(n_layers=2)
    base = model.init_params(cfg, jax.random.key(0))
    settings = lora.LoraSettings(rank=2, alpha=4.0, targets=("q_proj", "v_proj"))
    keys = iter(jax.random.split(jax.random.key(1), 8))
    adapters = {"blocks": {}}
    for layer in base["blocks"]:
        adapters["blocks"][layer] = {"attn": {}}
        for leaf in ("wq", "wv"):
            w = base["blocks"][layer]["attn"][leaf]
            a = jax.random.normal(next(keys), (w.shape[0], 2)) * 0.1
            b = jax.random.normal(next(keys), (2, w.shape[1])) * 0.1
            adapters["blocks"][layer]["attn"][leaf] = {"a": a, "b": b}
    batch = packed_batch()

    def loss_and_adapter_grads(c):
        def loss(ad):
            return model.loss_fn(lora.adapted(base, ad, settings), c, batch)[0]

        return jax.jit(jax.value_and_grad(loss))(adapters)

    loss, grads = loss_and_adapter_grads(cfg)
    loss_s, grads_s = loss_and_adapter_grads(with_execution(cfg, scan_layers=True))
    np.testing.assert_allclose(float(loss_s), float(loss), rtol=1e-6)
    assert_trees_close(grads_s, grads, rtol=1e-5, atol=1e-6)
