"""Where our train step does more work than the minimal loop: both compiled for the device
check's Llama shapes against abstract arguments (nothing allocated), then compared.

Programs (the device check's ``step_125m`` / ``step_350m`` settings: BF16 compute, FP32
master weights, the XLA attention, ``remat: full`` unless ``--remat`` says otherwise, and a
TPU recipe's loss in 1024-token chunks, ``models.execution.defaults_for("tpu")``):

- ``minimal``: ``minimal/llama.py``'s step (plain JAX + optax, the same remat, the loss over
  every token at once);
- ``ours``: ``make_train_step`` as the device check compiles it (``--scan-layers``, its
  default: the layers under one ``lax.scan``, the state stacked);
- ``ours_loop``: the same without the scan, as a TPU recipe runs by default.

Printed for each: XLA's ``cost_analysis()`` (flops, bytes accessed, transcendentals: a
``while`` body counted once, so a scan or a chunk loop reads as one iteration), the compiled
temporaries (``memory_analysis``), and the census of its optimised HLO with every loop
weighted by its trip count (``_hlo_census``): matrix-product FLOPs by dtypes, kernels and the
bytes they move by kind, elements converted, the products that differ from the minimal loop's,
the kernels that move the most bytes; then the StableHLO ops one program writes and the other
does not. Ratios are ours ÷ minimal.

On CPU ``ours`` is traced with the log-softmax the TPU runs (``cross_entropy.fp32_log_softmax``,
exponentials at their highest accuracy: what a chip's step computes), unless ``--cpu-softmax``.
On a TPU the script is its own one process (it opens the chip itself, as a worker would; it
starts no other). ``--for-chip`` compiles both for a TPU v5e on this CPU host instead
(libtpu's compiler, the ``tpu`` extra, as ``tpu_compile.py``: the chip's own programs, splash
kernels included, censused without a chip; nothing runs). ``--attention pallas`` (splash on
the chip), ``--grad-accum-steps`` and ``--remat auto`` (the plan a TPU recipe of the model
gets, ``device_check.settings.step_plan``) apply to both programs alike.

    uv run --locked python benchmarks/step_census.py [--size 350m|125m|tiny] [--backend cpu]
        [--no-scan-layers] [--loss-chunk-tokens 1024] [--remat full] [--json census.json]
    python benchmarks/step_census.py --backend tpu --size 350m --json census_tpu.json
    uv run --locked --extra tpu python benchmarks/step_census.py --for-chip --size 350m \
        --attention pallas --remat auto --programs minimal ours
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

#: what the comparison table shows of each census part (the rest is in the JSON)
TABLE_PARTS = ("dot_flops", "kernels", "bytes", "converts")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", choices=("125m", "350m", "tiny"), default="350m")
    parser.add_argument("--backend", choices=("cpu", "tpu"), default="cpu")
    parser.add_argument("--scan-layers", action=argparse.BooleanOptionalAction, default=True,
                        help="ours as the device check runs it (default: scanned)")  # fmt: skip
    parser.add_argument("--remat", default="full", help="both programs' (auto: the plan a TPU "
                        "recipe of the model gets, its micro-batches too)")  # fmt: skip
    parser.add_argument("--attention", choices=("xla", "pallas"), default="xla",
                        help="both programs' (pallas: splash on the chip)")  # fmt: skip
    parser.add_argument("--grad-accum-steps", type=int, default=1, help="both programs' "
                        "micro-batches (with --remat auto: the fewest)")  # fmt: skip
    parser.add_argument("--for-chip", action="store_true", help="compile for a TPU v5e on this "
                        "CPU host (libtpu, the tpu extra); --backend cpu")  # fmt: skip
    parser.add_argument("--loss-chunk-tokens", type=int, help="default: the TPU's (1024; tiny 32)")
    parser.add_argument("--cpu-softmax", action="store_true", help="on CPU, ours with the CPU's "
                        "log-softmax instead of the TPU's")  # fmt: skip
    parser.add_argument("--programs", nargs="+", default=["minimal", "ours", "ours_loop"])
    parser.add_argument("--top", type=int, default=8, help="kernels listed by bytes moved")
    parser.add_argument("--json", help="write every figure here")
    return parser.parse_args(argv)


def _shape_and_rows(size: str):
    from device_check import settings
    from minimal import llama as minimal

    if size == "tiny":
        return minimal.Shape(*settings.TINY_MODELS["350m"]), 2, settings.TINY_SEQ_LEN
    return minimal.Shape(*settings.MODELS[size]), settings.BATCH[size], settings.SEQ_LEN


def lowered_programs(args) -> dict:
    """``{name: lowered program}`` of ``args.programs`` against abstract arguments."""
    import jax
    import jax.numpy as jnp
    from device_check import settings
    from minimal import llama as minimal

    from minifield.data.packing import Rows
    from minifield.models import cross_entropy
    from minifield.models.execution import Execution, defaults_for

    shape, rows, seq = _shape_and_rows(args.size)
    found = defaults_for("tpu")
    chunk = args.loss_chunk_tokens
    if chunk is None:
        chunk = 32 if args.size == "tiny" else found[("training", "loss_chunk_tokens")]
    remat, accum = _plan(args, chunk)
    batch = Rows(
        *(jax.ShapeDtypeStruct((rows, seq), jnp.int32) for _ in "tsp"),
        jax.ShapeDtypeStruct((rows, seq), jnp.float32),
    )
    place, tracing = _placement(args)
    out = {}
    # the chip's log-softmax where this host's would be traced (--for-chip traces the chip's)
    swap = not args.for_chip and jax.default_backend() != "tpu" and not args.cpu_softmax
    softmax = cross_entropy.log_softmax
    if swap:
        cross_entropy.log_softmax = cross_entropy.fp32_log_softmax  # the chip's program
    try:
        with tracing():
            if "minimal" in args.programs:
                step, optimizer = minimal.step_function(
                    shape, jnp.bfloat16, settings.MAX_STEPS, args.attention, remat, accum
                )
                params = jax.eval_shape(lambda: minimal.init(shape, jax.random.key(0)))
                opt_state = jax.eval_shape(optimizer.init, params)
                jitted = jax.jit(step, donate_argnums=(0, 1))
                out["minimal"] = jitted.lower(place(params), place(opt_state), place(batch))
            for name, scan in (("ours", args.scan_layers), ("ours_loop", False)):
                if name in args.programs:
                    how = Execution(
                        attention=args.attention, scan_layers=scan, remat=remat,
                        loss_chunk_tokens=chunk, backend="tpu",
                    )  # fmt: skip
                    jitted, state = _ours(settings.llama_config(shape, seq, how), accum)
                    out[name] = jitted.lower(place(state), place(batch))
    finally:
        cross_entropy.log_softmax = softmax
    return out


def _ours(cfg, accum: int):
    """Our update of ``cfg`` over ``accum`` micro-batches, jitted with the state donated, and
    its state's shapes."""
    import jax
    from device_check import settings

    from minifield.training.optimizer import make_optimizer
    from minifield.training.train_step import init_train_state, make_train_step

    optimizer = make_optimizer({}, settings.MAX_STEPS)
    state = jax.eval_shape(lambda: init_train_state(cfg, optimizer, seed=0))
    step = make_train_step(cfg, optimizer, accum_steps=accum)
    return jax.jit(step, donate_argnums=(0,)), state


def _plan(args, chunk: int) -> tuple[str, int]:
    """Both programs' remat policy and micro-batches: as asked, or ``--remat auto``'s plan
    for a TPU recipe of the model (``device_check.settings.step_plan``)."""
    from device_check import settings

    if args.remat != "auto":
        return args.remat, args.grad_accum_steps
    how = argparse.Namespace(
        tiny=args.size == "tiny", batch=None, attention=args.attention, remat="auto",
        grad_accum_steps=args.grad_accum_steps, loss_chunk_tokens=chunk,
    )  # fmt: skip
    plan = settings.step_plan(how, "350m" if args.size == "tiny" else args.size)
    return plan.remat, plan.grad_accum_steps


def _placement(args):
    """``(place, tracing)``: the arguments as the programs are compiled for them, and the
    context they are traced in: with ``--for-chip`` a TPU v5e's (``tpu_compile.for_chip``);
    else as they are, on this host."""
    import contextlib

    if not args.for_chip:
        return (lambda tree: tree), contextlib.nullcontext
    import tpu_compile

    return tpu_compile.for_chip()


def measure(lowered) -> dict:
    """One program's figures: XLA's cost analysis, its memory, the census, StableHLO ops."""
    import _hlo_census

    started = time.perf_counter()
    compiled = lowered.compile()
    seconds = time.perf_counter() - started
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    memory = compiled.memory_analysis()
    found = _hlo_census.census(compiled.as_text())
    return {
        "compile_s": seconds,
        "cost_analysis": {k: cost.get(k) for k in ("flops", "bytes accessed", "transcendentals")},
        "temp_bytes": getattr(memory, "temp_size_in_bytes", None),
        **found,
        "total_dot_flops": sum(found["dot_flops"].values()),
        "total_kernel_bytes": sum(found["bytes"].values()),
        "total_kernels": sum(found["kernels"].values()),
        "stablehlo": _hlo_census.stablehlo_ops(lowered.as_text()),
    }


def _ratio(a, b) -> str:
    if not b:
        return "-" if not a else "new"
    return f"{a / b:.3f}"


def _row(label: str, values: list, base) -> str:
    cells = [f"{v:>14.4g}" if isinstance(v, int | float) else f"{'-':>14}" for v in values]
    ratios = [f"{_ratio(v, base):>7}" for v in values[1:]] if isinstance(base, int | float) else []
    return f"  {label[:44]:<44}" + "".join(cells) + "  " + " ".join(ratios)


def report(results: dict, top: int) -> str:
    """The comparison as text: each figure of every program, and ÷ the first program's."""
    names = list(results)
    lines = [f"  {'figure':<44}" + "".join(f"{n:>14}" for n in names) + "  ÷ " + names[0]]
    first = results[names[0]]
    totals = ("total_dot_flops", "total_kernel_bytes", "total_kernels", "temp_bytes")
    for key in (*first["cost_analysis"], *totals):
        where = "cost_analysis" if key in first["cost_analysis"] else None
        values = [(r[where] if where else r).get(key) for r in results.values()]
        lines.append(_row(f"{'xla ' if where else ''}{key}", values, values[0]))
    for part in TABLE_PARTS:
        lines.append(f"  {part}:")
        keys = sorted({k for r in results.values() for k in r[part]})
        for key in keys:
            values = [r[part].get(key, 0) for r in results.values()]
            if any(values):
                lines.append(_row(f"  {key}", values, values[0]))
    lines.append("  products whose count differs (shapes: count a step):")
    keys = sorted({k for r in results.values() for k in r["dots"]})
    for key in keys:
        counts = [r["dots"].get(key, 0) for r in results.values()]
        if len(set(counts)) > 1:
            lines.append(f"    {key[:110]}: " + ", ".join(f"{c:g}" for c in counts))
    lines.append("  StableHLO ops written a different number of times:")
    keys = sorted({k for r in results.values() for k in r["stablehlo"]})
    for key in keys:
        counts = [r["stablehlo"].get(key, 0) for r in results.values()]
        if len(set(counts)) > 1:
            lines.append(f"    {key}: " + ", ".join(str(c) for c in counts))
    for name, r in results.items():
        lines.append(f"  {name}: the {top} kernels moving the most bytes (GB a step)")
        lines += [f"    {b / 1e9:9.3f}  {label[:150]}" for label, b in r["top"][:top]]
    return "\n".join(lines)


def main(argv=None) -> int:
    import _hlo_census

    args = parse_args(argv)
    if args.for_chip and not _hlo_census.compiles_for_chip("step_census", args.backend):
        return 2
    if not _hlo_census.start_backend("step_census", args.backend):
        return 2
    results = {name: measure(lowered) for name, lowered in lowered_programs(args).items()}
    print(f"step census: {args.size}, backend {args.backend}"
          f"{' (compiled for a TPU v5e)' if args.for_chip else ''}, attention {args.attention}, "
          f"remat {args.remat}, micro-batches from {args.grad_accum_steps}, ours "
          f"{'scanned' if args.scan_layers else 'looped'}")  # fmt: skip
    print(report(results, args.top))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
