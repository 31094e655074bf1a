"""An estimate of a packed-sft step's device memory, and the refusal of a recipe whose step does
not fit the device it names (``runtime.device_memory_bytes``; docs/quantized-base.md).

The estimate, in bytes, of one update of ``training.batch_size / training.grad_accum_steps``
rows of ``training.seq_len`` tokens (:func:`estimate`, each part recorded):

- ``state``: full fine-tuning, every parameter's FP32 value, gradient and two AdamW moments
  and half an FP32 copy of the update's temporaries (18 bytes each; 29 with gradient
  accumulation: the accumulator, a micro-batch's gradient, their sum); LoRA, the frozen base
  as held (each block matrix's codes and scales under ``model.lora.base_quantization``, else
  ``base_dtype``; the rest in ``base_dtype``), the quantized matrices made back to
  ``base_dtype`` (one layer's twice with ``model.scan_layers``, forward and backward; every
  layer's without), the step's transposed copy of every other matrix HF stores ``[out, in]``
  (:mod:`minifield.hf.stored_base`: the head's; without ``model.scan_layers`` the unquantized
  blocks' too, which a scanned run transposes and stacks once as it places the base), and the
  adapters as full fine-tuning's parameters;
- ``activations``, per row: with ``training.remat: full`` (or ``offload_attention``), each
  layer's FP32 input kept (``n_layers * T * d_model * 4``) plus one and a half layers' working
  sets; otherwise, per layer, :data:`WORKING_SETS` of the policy's. A layer's working set:
  ``T * 4 * (8 d_model + 4 d_ff)``; with the XLA attention, its FP32 scores, probabilities and
  their two gradients (``4 * heads * T * T * 4``: one layer's with ``full``, every layer's
  otherwise);
- ``logits``: three FP32 ``[tokens, vocab]`` arrays (logits, probabilities, their gradient)
  of ``training.loss_chunk_tokens`` tokens, or of every row's tokens without chunks.

Against the chip's compiled peaks (``benchmarks/device_check``'s ``shapes`` section, TPU v5e,
Qwen2.5-0.5B full fine-tune, 2048 tokens a row, remat full, chunks of 1024, BF16 compute):
1 row 10.28 GB measured, 12.20 estimated; 4 rows 13.80, 16.53; 6 rows 16.53, 19.42: above
every measured figure (by 12 to 20 %): on these figures it errs towards refusing (5 and 6
rows fit the chip's 16.91 GB; the estimate refuses them), and every step it admits fit. That
is full fine-tuning's calibration: LoRA's parts are the arithmetic of what it holds, not yet compared
with the chip's compiled peaks (docs/tpu.md). The remat policies' constants
(:data:`WORKING_SETS`, :data:`FULL_WORKING_SETS`) and the bytes a trained parameter costs
(:data:`TRAINED_BYTES`, :data:`ACCUMULATING_BYTES`) are calibrated on the device check's 125M
and 350M steps compiled for the chip, every policy at 1 to 32 rows a micro-batch, and rounded
up: the estimate is above each of those 33 compiled peaks (docs/quantized-base.md).
"""

from __future__ import annotations

import math

from .families import expected_tensors
from .lora_targets import TARGETS

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
#: FP32 value, gradient and AdamW's two moments, and half an FP32 copy the update's
#: temporaries hold (calibrated: see the module)
TRAINED_BYTES = 18
#: with gradient accumulation: the accumulator, each micro-batch's gradient beside it and its
#: sum's temporaries (calibrated: see the module)
ACCUMULATING_BYTES = 11
#: per row, the layer working sets (``T * 4 * (8 d_model + 4 d_ff)``) a ``training.remat``
#: policy keeps live, per layer (``full``: in all, beside each layer's FP32 input; calibrated:
#: see the module). ``offload_attention`` keeps its saved tensors in the host's memory: on the
#: device what ``full`` holds.
WORKING_SETS = {"none": 1.6, "dots_saveable": 0.65, "save_attention": 0.45}
FULL_WORKING_SETS = 1.5


def _params(cfg) -> dict[str, tuple[tuple[int, ...], bool]]:
    """Internal path -> (this project's ``[in, out]`` shape, whether HF stores it ``[out,
    in]``) of every parameter."""
    out = {}
    for _, (internal, transpose, shape) in expected_tensors(cfg).items():
        parts = (internal,) if isinstance(internal, str) else internal
        for path in parts:  # a fused matrix's parts (Phi-3): no LoRA, full fine-tuning's count
            out[path] = (tuple(shape[::-1]) if transpose else tuple(shape), transpose)
    return out


def held_bytes(shape: tuple, scheme: str | None, block: int | None, double: bool, dtype: str):
    """Bytes of one frozen base matrix ``[in, out]`` as held: codes and scales (see
    :mod:`.quantize`), or ``dtype``'s."""
    from .quantize import NF4_BLOCK, SCALE_GROUP  # imports JAX: not at validation

    n_in, n_out = shape
    if scheme is None:
        return n_in * n_out * DTYPE_BYTES[dtype]
    size = n_in if block is None and scheme == "int8" else (block or NF4_BLOCK)
    codes = n_in * n_out if scheme == "int8" else n_in * n_out // 2
    scales = n_in // size * n_out
    if not double:
        return codes + 4 * scales
    return codes + scales + 4 * math.ceil(scales / SCALE_GROUP) + 4


def _state(cfg, recipe: dict, accum: bool) -> int:
    model = recipe["model"]
    lora = model.get("lora")
    params = _params(cfg)
    per_trained = TRAINED_BYTES + (ACCUMULATING_BYTES if accum else 0)
    if lora is None:
        return per_trained * sum(math.prod(shape) for shape, _ in params.values())
    from .quantize import is_quantized

    scheme = lora.get("base_quantization")
    scheme = None if scheme in (None, "none") else scheme
    dtype, targets = lora["base_dtype"], _target_params(lora["targets"])
    block, double = lora.get("quantization_block"), lora.get("double_quantization", False)
    held = copies = made_back = layer = adapters = 0
    scanned = model.get("scan_layers", False)
    for path, (shape, stored_out_in) in params.items():
        size = math.prod(shape) * DTYPE_BYTES[dtype]
        matrix = is_quantized(path, len(shape))  # a block's matrix
        if scheme is not None and matrix:
            held += held_bytes(shape, scheme, block, double, dtype)
            made_back += size
            layer += size if path.startswith("blocks/00/") else 0
        else:
            held += size
            # the step's transposed copy of a stored [out, in] matrix (hf.stored_base); a
            # scanned run's are transposed once, as placed (its blocks stacked, its head)
            copies += size if stored_out_in and not scanned else 0
        if matrix and path.rsplit("/", 1)[-1] in targets:
            adapters += lora["rank"] * sum(shape)
    if scheme is not None and scanned:
        made_back = 2 * layer  # one layer's, forward and backward
    return held + copies + made_back + per_trained * adapters


def _target_params(targets) -> set[str]:
    """The parameter names (``wq``, ...) of ``model.lora.targets`` (the dense matrices)."""
    return {TARGETS[t].rsplit("/", 1)[-1] for t in targets if TARGETS.get(t)}


def _activations_per_row(cfg, recipe: dict) -> int:
    T, D, F = recipe["training"]["seq_len"], cfg.d_model, cfg.d_ff
    working = T * 4 * (8 * D + 4 * F)
    scores = 4 * cfg.n_heads * T * T * 4 if recipe["model"].get("attention", "xla") == "xla" else 0
    remat = recipe["training"].get("remat", "none")
    if remat in ("full", "offload_attention"):
        return cfg.n_layers * T * D * 4 + math.ceil(FULL_WORKING_SETS * working) + scores
    return cfg.n_layers * (math.ceil(WORKING_SETS[remat] * working) + scores)


def estimate(cfg, recipe: dict) -> dict[str, int]:
    """The step's bytes by part and in all (``total``); see the module."""
    training = recipe["training"]
    accum = training.get("grad_accum_steps", 1)
    rows = training["batch_size"] // accum
    tokens = rows * training["seq_len"]
    chunk = training.get("loss_chunk_tokens", 0)
    parts = {
        "state": _state(cfg, recipe, accum > 1),
        "activations": rows * _activations_per_row(cfg, recipe),
        "logits": 3 * 4 * cfg.vocab_size * (min(chunk, tokens) if chunk else tokens),
    }
    return {**parts, "total": sum(parts.values())}


def problem(cfg, recipe: dict) -> str | None:
    """Why the step does not fit ``runtime.device_memory_bytes`` (None: it fits, or the recipe
    gives no device memory)."""
    limit = recipe.get("runtime", {}).get("device_memory_bytes")
    if limit is None:
        return None
    parts = estimate(cfg, recipe)
    if parts["total"] <= limit:
        return None
    training = recipe["training"]
    rows = training["batch_size"] // training.get("grad_accum_steps", 1)
    said = ", ".join(f"{k} {v / 1e9:.2f}" for k, v in parts.items() if k != "total")
    return (
        f"the step needs an estimated {parts['total'] / 1e9:.2f} GB ({said}) for {rows} "
        f"row{'s' if rows != 1 else ''} of "
        f"{training['seq_len']} tokens, above runtime.device_memory_bytes "
        f"{limit / 1e9:.2f} GB; lower training.batch_size (or raise training.grad_accum_steps), "
        "training.seq_len, quantize the base (model.lora.base_quantization) or set "
        "training.remat full"
    )
