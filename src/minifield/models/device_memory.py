"""An estimate of a packed-sft step's device memory, the refusal of a recipe whose step does
not fit the device it names (``runtime.device_memory_bytes``; docs/quantized-base.md), and the
policy and micro-batches ``training.remat: auto`` chooses by it (:func:`plan`; docs/tpu.md).

The estimate, in bytes, of a device's micro-batch of one update, ``training.batch_size /
(training.data_parallel.devices x training.grad_accum_steps)`` rows of ``training.seq_len``
tokens (:func:`estimate`, each part recorded):

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
from dataclasses import dataclass

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


def _rows_per_device(training: dict) -> int:
    """The rows of one update a device holds (each device of a mesh its share)."""
    return training["batch_size"] // training.get("data_parallel", {}).get("devices", 1)


def estimate(cfg, recipe: dict) -> dict[str, int]:
    """The step's bytes by part and in all (``total``); see the module."""
    training = recipe["training"]
    accum = training.get("grad_accum_steps", 1)
    rows = _rows_per_device(training) // accum
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
    found = plan(cfg, recipe)
    recipe = with_plan(recipe, found)
    parts = estimate(cfg, recipe)
    if parts["total"] <= limit:
        return None
    training = recipe["training"]
    rows = _rows_per_device(training) // training.get("grad_accum_steps", 1)
    said = ", ".join(f"{k} {v / 1e9:.2f}" for k, v in parts.items() if k != "total")
    return (
        f"the step needs an estimated {parts['total'] / 1e9:.2f} GB ({said}) for {rows} "
        f"row{'s' if rows != 1 else ''} of "
        f"{training['seq_len']} tokens, above runtime.device_memory_bytes "
        f"{limit / 1e9:.2f} GB; lower training.batch_size (or raise training.grad_accum_steps), "
        "training.seq_len, quantize the base (model.lora.base_quantization) or set "
        "training.remat full"
    )


#: ``training.remat: auto`` (packed-sft's default on a TPU, :func:`plan`): the policy it runs
#: where the step fits, the one it falls back to, the device memory it sizes the step for (a
#: TPU v5e's ``bytes_limit``: the rule, not the run's device, decides, so the recipe alone
#: fixes what it computes) and the fewest tokens a micro-batch it adds may hold. On the chip
#: (docs/tpu.md, "350M: what each remat policy costs on the chip") not recomputing the
#: forward pass won at every split that fit: ``dots_saveable`` in 4 micro-batches of 2 rows
#: 22 % faster than ``full``, and 8 micro-batches of one 2048-token row with ``none`` 20 %.
AUTO_POLICY, AUTO_FALLBACK = "dots_saveable", "full"
AUTO_DEVICE_BYTES = 16_909_336_064
AUTO_MIN_MICRO_TOKENS = 2048


@dataclass(frozen=True)
class Plan:
    """How a step computes in memory: its ``training.remat`` policy and micro-batches, and
    ``estimated_bytes`` (:func:`estimate`) where ``training.remat: auto`` chose them."""

    remat: str
    grad_accum_steps: int
    estimated_bytes: int | None = None

    def describe(self) -> dict:
        """What the run's ``compiled`` event records."""
        return {"remat": self.remat, "grad_accum_steps": self.grad_accum_steps,
                "estimated_bytes": self.estimated_bytes}  # fmt: skip


def with_plan(recipe: dict, found: Plan) -> dict:
    """``recipe`` spelling ``found``'s policy and micro-batches (a shallow copy)."""
    training = {**recipe["training"], "remat": found.remat}
    training["grad_accum_steps"] = found.grad_accum_steps
    return {**recipe, "training": training}


def plan(cfg, recipe: dict) -> Plan:
    """The recipe's ``training.remat`` and ``grad_accum_steps`` as it spells them, or, for
    ``remat: auto``, the rule's choice for the model ``cfg``: :data:`AUTO_POLICY` in the fewest
    micro-batches, at least the recipe's ``grad_accum_steps``, that divide a device's rows and
    whose step :func:`estimate` puts within :data:`AUTO_DEVICE_BYTES` (a split beyond the
    recipe's only while each micro-batch keeps :data:`AUTO_MIN_MICRO_TOKENS`); where none does,
    and for LoRA, whose estimate is calibrated for :data:`AUTO_FALLBACK` alone,
    :data:`AUTO_FALLBACK` at the recipe's micro-batches."""
    training = recipe["training"]
    remat, accum = training.get("remat", "none"), training.get("grad_accum_steps", 1)
    if remat != "auto":
        return Plan(remat, accum)
    if "lora" in recipe["model"]:
        # LoRA's estimate is not calibrated for the policy: a 3B NF4 step at one row of 2048
        # compiled for the chip to 16.45 GB where it estimates 13.34 (docs/tpu.md)
        total = estimate(cfg, with_plan(recipe, Plan(AUTO_FALLBACK, accum)))["total"]
        return Plan(AUTO_FALLBACK, accum, total)
    rows = _rows_per_device(training)
    for split in range(accum, rows + 1):
        if rows % split:
            continue
        if split > accum and rows // split * training["seq_len"] < AUTO_MIN_MICRO_TOKENS:
            break
        total = estimate(cfg, with_plan(recipe, Plan(AUTO_POLICY, split)))["total"]
        if total <= AUTO_DEVICE_BYTES:
            return Plan(AUTO_POLICY, split, total)
    total = estimate(cfg, with_plan(recipe, Plan(AUTO_FALLBACK, accum)))["total"]
    return Plan(AUTO_FALLBACK, accum, total)


def auto_rule_digest() -> str:
    """The first 16 hex digits of the sha256 of what :func:`plan`'s rule decides by (its
    policies, device bytes, micro-batch floor and :func:`estimate`'s constants): what a
    recipe with ``training.remat: auto`` records (``training.remat_rule``), so its
    computation digest changes with the rule."""
    import hashlib
    import json

    rule = {
        "policy": AUTO_POLICY, "fallback": AUTO_FALLBACK, "device_bytes": AUTO_DEVICE_BYTES,
        "min_micro_tokens": AUTO_MIN_MICRO_TOKENS, "trained": TRAINED_BYTES,
        "accumulating": ACCUMULATING_BYTES, "working_sets": WORKING_SETS,
        "full_working_sets": FULL_WORKING_SETS, "dtype_bytes": DTYPE_BYTES,
        "lora": AUTO_FALLBACK,
    }  # fmt: skip
    text = json.dumps(rule, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]
