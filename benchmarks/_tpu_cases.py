"""The programs ``tpu_compile.py`` compiles for the chip, each built as its benchmark builds it
and every argument abstract (``jax.ShapeDtypeStruct``: nothing allocated, no base quantized):

- :func:`qlora`: ``qlora_step.py``'s LoRA step on a BF16, int8 or NF4 base (its ``run_mode``),
  the quantized base's leaves from :func:`abstract_leaves`;
- :func:`shapes`: the device check's ``shapes`` section's full fine-tuning or LoRA step
  (``section_shapes.abstract_step``);
- :func:`step`: the device check's 125M / 350M step (``section_steps``), at its TPU settings.

Each returns ``(jitted step, arguments, description)``; the arguments still without a
device (``tpu_compile.on_device`` gives them the chip's). :func:`abstract_leaves` needs no
JAX (the CPU test checks it against ``quantize_matrix``'s real output).
"""

from __future__ import annotations

import math
import types

import numpy as np

from minifield.hf import quantized_base


def abstract_leaves(K: int, N: int, scheme: str, block: int | None, double: bool) -> dict:
    """The ``(shape, dtype)`` of each of :data:`quantized_base.LEAVES` (None where absent) of
    an ``[in K, out N]`` matrix as :func:`quantized_base.quantize_matrix` makes them: codes
    ``[K, N]`` int8 (NF4: two a byte, ``[K / 2, N]`` uint8), one FP32 absmax per block of
    ``block`` inputs (None: the whole column) and output; doubly quantized, those as int8,
    an FP32 absmax per :data:`quantized_base.SCALE_GROUP` of them (the last group padded)
    and their FP32 mean, a scalar."""
    size = K if block is None else block
    codes = ((K // 2, N), np.dtype(np.uint8)) if scheme == "nf4" else ((K, N), np.dtype(np.int8))
    scales_shape = (K // size, N)
    if not double:
        return {"codes": codes, "scales": (scales_shape, np.dtype(np.float32)),
                "scale_scales": None, "offset": None}  # fmt: skip
    groups = math.ceil(math.prod(scales_shape) / quantized_base.SCALE_GROUP)
    return {"codes": codes, "scales": (scales_shape, np.dtype(np.int8)),
            "scale_scales": ((groups,), np.dtype(np.float32)),
            "offset": ((), np.dtype(np.float32))}  # fmt: skip


def abstract_base(cfg, settings):
    """The frozen base of ``cfg`` as ``placement.frozen_base`` places it for ``settings`` (a
    ``LoraSettings``), every leaf a ``ShapeDtypeStruct``: the checkpoint's BF16 tensors
    (``stored_base.zeros``), each block matrix of a quantized base its codes and scales in
    ``[in, out]`` (``quantized_base.on_device``), the layers stacked once where they are
    scanned (``stored_base.stacked``)."""
    import jax

    from minifield.hf import stored_base
    from minifield.models.quantize import QuantizedWeight, is_quantized

    base = jax.eval_shape(lambda: stored_base.zeros(cfg, settings.base_dtype))
    if settings.quantization is not None:
        scheme = settings.quantization
        block = settings.block
        if scheme == "nf4" and block is None:
            block = quantized_base.NF4_BLOCK
        items, out_in = [], set()
        for path, value in stored_base.flatten(base.params):
            transposed = path in base.out_in
            if not is_quantized(path, len(value.shape)):
                items.append((path, value))
                out_in.update([path] if transposed else [])
                continue
            K, N = value.shape[::-1] if transposed else value.shape  # [in, out]
            leaves = abstract_leaves(K, N, scheme, block, settings.double)
            made = {
                leaf: None if found is None else jax.ShapeDtypeStruct(*found)
                for leaf, found in leaves.items()
            }
            weight = QuantizedWeight(*(made[leaf] for leaf in quantized_base.LEAVES),
                                     scheme, block, (K, N))  # fmt: skip
            items.append((path, weight))
        host = quantized_base.host_paths([(path, None, None) for path, _ in items])
        base = stored_base.FrozenBase(
            stored_base.nest(items), frozenset(out_in), base.dtype, frozenset(host)
        )
    if cfg.execution.scan_layers:
        base = jax.eval_shape(stored_base.stacked, base)
    return base


def rows(batch: int, seq: int):
    """A packed batch's shapes: int32 tokens, segments and positions, the FP32 loss mask."""
    import jax

    from minifield.data.packing import Rows

    ints = jax.ShapeDtypeStruct((batch, seq), np.int32)
    return Rows(ints, ints, ints, jax.ShapeDtypeStruct((batch, seq), np.float32))


def qlora(args):
    """``qlora_step.run_mode``'s step (LoRA on every linear layer, its optimizer, the state
    donated) for ``args.mode`` and ``args.kernel``, with ``args.loss_chunk_tokens``."""
    import dataclasses

    import jax
    import qlora_step

    from minifield.training import lora, optimizer

    cfg = qlora_step.config(args)
    how = dataclasses.replace(cfg.execution, loss_chunk_tokens=args.loss_chunk_tokens)
    if args.attention == "splash":  # what a recipe naming the TPU gets at 2048-token rows
        how = dataclasses.replace(how, attention="pallas", backend="tpu")
    cfg = dataclasses.replace(cfg, execution=how)
    scheme = None if args.mode == "bf16" else args.mode
    targets = tuple(name for name, dense in lora.TARGETS.items() if dense)
    settings = lora.LoraSettings(args.rank, float(2 * args.rank), targets, "bfloat16", scheme,
                                 args.block, scheme == "nf4" and not args.no_double)  # fmt: skip
    training = {"warmup_steps": 2, "learning_rate": 1e-4}
    if args.optimizer == "pipeline":  # qlora_pipeline.complete()'s recipe
        training = {"learning_rate": 0.003, "warmup_steps": 1, "decay": "cosine"}
    steps = 4 if args.optimizer == "pipeline" else 1000
    opt = optimizer.make_optimizer(training, steps)
    schedule = optimizer.make_schedule(training, steps)
    step = jax.jit(lora.make_train_step(cfg, settings, opt, schedule), donate_argnums=(0,))
    state = jax.eval_shape(lambda: lora.init_state(cfg, settings, opt, 0, np.zeros(32, np.uint8)))
    base = abstract_base(cfg, settings)
    arguments = (state, base, rows(args.batch, args.seq))
    described = {"execution": _execution(cfg), "lora_rank": args.rank,
                 "state_bytes": nbytes(state), "base_bytes": base_parts(base)}  # fmt: skip
    return step, arguments, described


def nbytes(tree) -> int:
    """The bytes of ``tree``'s leaves as shapes and dtypes say (no device's padding)."""
    import jax

    leaves = jax.tree_util.tree_leaves(tree)
    return int(sum(math.prod(a.shape) * np.dtype(a.dtype).itemsize for a in leaves))


def base_parts(base) -> dict:
    """The frozen base's bytes by part: the block matrices' codes and their scales (the
    doubly quantized scales' own scales and offset with them), the embedding, the head (absent
    where tied) and the rest (norms)."""
    from minifield.hf import stored_base
    from minifield.hf.stored_base import QUANTIZED_MATRICES
    from minifield.models.quantize import QuantizedWeight

    parts = {"codes": 0, "scales": 0, "matrices": 0, "embedding": 0, "head": 0, "other": 0}
    for path, value in stored_base.flatten(base.params):
        if isinstance(value, QuantizedWeight):
            parts["codes"] += nbytes(value.codes)
            parts["scales"] += nbytes([value.scales, value.scale_scales, value.offset])
        elif path.startswith("blocks/") and path.rsplit("/", 1)[-1] in QUANTIZED_MATRICES:
            parts["matrices"] += nbytes(value)  # a BF16 base's
        else:
            part = {"embed": "embedding", "head": "head"}.get(path.split("/")[0], "other")
            parts[part] += nbytes(value)
    return parts


def shapes(args):
    """``section_shapes.abstract_step`` of ``args.model`` in ``args.shapes_mode`` at the device
    check's TPU settings (``--remat``, ``--loss-chunk-tokens``, splash attention)."""
    from device_check import section_shapes
    from device_check import settings as check

    how = check.execution(_device_check_settings(args))  # auto: full, as the section takes it
    cfg = section_shapes.config(args.model, False, how)
    step, leading, trained = section_shapes.abstract_step(cfg, args.shapes_mode)
    arguments = (*leading, rows(args.rows, cfg.max_len))
    return step, arguments, {"execution": _execution(cfg), "trained_params": trained}


def step(args):
    """The device check's ``step_125m`` / ``step_350m`` update of ours (``section_steps``):
    ``make_train_step`` over ``--grad-accum-steps`` micro-batches, the state donated."""
    import jax
    from device_check import settings as check

    from minifield.training.optimizer import make_optimizer
    from minifield.training.train_step import init_train_state, make_train_step

    if args.rows % args.grad_accum_steps:
        raise SystemExit(f"--grad-accum-steps {args.grad_accum_steps} does not divide --rows "
                         f"{args.rows}")  # fmt: skip
    how = _device_check_settings(args)
    plan = check.step_plan(how, args.size)  # the TPU's default remat: auto's plan
    shape = check.model_shape(how, args.size)
    cfg = check.llama_config(shape, check.SEQ_LEN, check.execution(how, plan.remat))
    opt = make_optimizer({}, check.MAX_STEPS)
    state = jax.eval_shape(lambda: init_train_state(cfg, opt, seed=0))
    fn = make_train_step(cfg, opt, accum_steps=plan.grad_accum_steps)
    jitted = jax.jit(fn, donate_argnums=(0,))
    arguments = (state, rows(args.rows, check.SEQ_LEN))
    return jitted, arguments, {"execution": _execution(cfg), "memory_plan": plan.describe()}


def _device_check_settings(args):
    """The device check's settings with ``--backend tpu`` (``settings.execution`` and
    ``step_plan`` read them): its attention (splash at 2048 tokens), ``--remat``,
    ``--grad-accum-steps``, ``--rows`` and ``--loss-chunk-tokens`` (absent: the TPU's
    defaults, ``auto`` and 1024)."""
    from device_check import settings as check

    remat, chunk = check.memory_defaults("tpu")
    return types.SimpleNamespace(
        attention=check.default_attention("tpu", False), scan_layers=True,
        remat=args.remat or remat, tiny=False, backend="tpu", batch=args.rows,
        grad_accum_steps=getattr(args, "grad_accum_steps", 1),
        loss_chunk_tokens=chunk if args.loss_chunk_tokens is None else args.loss_chunk_tokens,
    )  # fmt: skip


def _execution(cfg) -> dict:
    how = cfg.execution
    return {"attention": how.attention, "backend": how.backend, "scan_layers": how.scan_layers,
            "remat": how.remat, "loss_chunk_tokens": how.loss_chunk_tokens,
            "quantized_kernel": how.quantized_kernel}  # fmt: skip
