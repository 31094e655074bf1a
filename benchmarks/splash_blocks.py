"""Splash attention's block sizes on the chip: each kernel's blocks swept on its own, by row
length and head width, with the XLA attention path and an all-512 baseline timed in the same
run; its ``best`` is ``splash_table.SPLASH_BLOCKS``'s table.

The attention of ``model.attention: pallas`` with ``runtime.backend: tpu``
(``minifield.models.layers.tpu_attention``) over packed rows: causal, ``--segments``
segments a row of unequal lengths, ``--d-model`` split into heads of each ``--head-dims``
width (16 of 64 and 8 of 128 at 1024: the 350M model's width), ``--tokens`` a call (rows =
tokens / row length, so every length does the same projections' work). Splash has three
kernels, each with its own blocks:

- ``forward``: ``block_q``, ``block_kv``, ``block_kv_compute``; timed alone (a forward-only
  program);
- ``dkv`` (the keys' and values' gradients): ``block_q_dkv``, ``block_kv_dkv``,
  ``block_kv_dkv_compute``; ``dq``: ``block_q_dq``, ``block_kv_dq``; timed as forward and
  backward, every other kernel's blocks held, so a difference is that kernel's.

Each kernel on its own, every block not swept held at ``HELD`` (512; fitted to the row),
in two rounds (:func:`first_round`, :func:`second_round`): the query block over the
candidates, the key block over them (its compute block held); then the compute block at and
below the fastest key block, with the fastest query block. A shape's best joins the three
kernels' fastest and is timed against the baseline and the XLA path. Every program's
output (and gradients) is compared with the XLA path's (``max_abs_vs_xla``; with the
baseline's where the XLA path does not fit, ``max_abs_vs_splash``). The candidates are
{256, 512, 1024, 2048} up to the row: 128 (splash's default) was the slowest key block on the
chip (45.6 ms against 14.0 for 1024 at 2048 tokens, ``docs/tpu.md``) and every block 128 the
slowest 350M step (2.06 s against 0.71), and a block longer than 2048 holds a ``[block_q,
block_kv]`` FP32 score tile of 16 MiB or more, past the TPU core's vector memory.

A round's programs are compiled together on the host's cores (``--compile-threads``), then
timed one at a time (``--rounds`` calls each, the median). Shapes run in the order given
(the recipes' 2048 first) while ``--budget-s`` has room for another as long as the longest
so far; the JSON is written after each (``complete`` per shape) and ``--resume`` continues
one that ran out of time, keeping what it measured.

On the chip (one call; ``docs/tpu.md``):

    python benchmarks/splash_blocks.py --out splash_blocks.json

On CPU, a smoke check at tiny sizes in Pallas's interpreter (its times say nothing about
the chip):

    uv run python benchmarks/splash_blocks.py --tiny
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from splash_search import KERNELS, first_round, held, joined, second_round, table  # noqa: E402

from minifield.models.layers import attention, tpu_attention  # noqa: E402
from minifield.models.llama import LlamaConfig  # noqa: E402

HELD = 512
CANDIDATES = (256, 512, 1024, 2048)
SHAPES = ["2048x64", "2048x128", "4096x64", "4096x128", "1024x64", "1024x128"]
SHAPES += ["8192x64", "8192x128"]
TINY = dict(shapes=["256x64", "256x128"], tokens=256, d_model=256, candidates=[128, 256])
TINY.update(held=128, rounds=1, compile_threads=2)
FORMAT = "minifield-splash-blocks/1"
F32 = jnp.float32


# ----------------------------------------------------------------------------- the programs


def shape_of(text: str) -> tuple[int, int]:
    seq_len, head_dim = (int(part) for part in text.split("x"))
    return seq_len, head_dim


def config(args, seq_len: int, head_dim: int) -> LlamaConfig:
    heads = args.d_model // head_dim
    return LlamaConfig(
        vocab_size=256,
        d_model=args.d_model,
        n_layers=1,
        n_heads=heads,
        n_kv_heads=heads,
        head_dim=head_dim,
        d_ff=4,
        max_len=seq_len,
        compute_dtype=args.dtype,
    )


def packed_segments(batch: int, seq_len: int, count: int) -> np.ndarray:
    """``count`` segments a row, of unequal lengths (boundaries off the block grid)."""
    rng = np.random.default_rng(0)
    segments = np.zeros((batch, seq_len), np.int32)
    for b in range(batch):
        cuts = np.sort(rng.choice(np.arange(1, seq_len), count - 1, replace=False))
        segments[b] = np.searchsorted(cuts, np.arange(seq_len), side="right") + 1
    return segments


def inputs(cfg: LlamaConfig, batch: int, seq_len: int, segments: int):
    keys = jax.random.split(jax.random.key(0), 4)
    H, G, K = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    q = jax.random.normal(keys[0], (batch, seq_len, H, K), cfg.dtype)
    k = jax.random.normal(keys[1], (batch, seq_len, G, K), cfg.dtype)
    v = jax.random.normal(keys[2], (batch, seq_len, G, K), cfg.dtype)
    cotangent = jax.random.normal(keys[3], (batch, seq_len, H * K), cfg.dtype)
    return (q, k, v), cotangent, jnp.asarray(packed_segments(batch, seq_len, segments))


class Shape:
    """One row length and head width: its inputs, its programs lowered, compiled and timed
    (each program once: the dkv and dq sweeps share their baseline)."""

    def __init__(self, args, seq_len: int, head_dim: int, interpret: bool):
        self.args, self.interpret = args, interpret
        self.cfg = config(args, seq_len, head_dim)
        rows = max(1, args.tokens // seq_len)
        qkv, cotangent, segments = inputs(self.cfg, rows, seq_len, args.segments)
        # every array an argument of the programs, none a constant compiled into them
        self.operands = (*qkv, cotangent, segments)
        self.rows, self.timed = rows, {}
        self.reference = self.reference_name = None  # the first step's: the XLA path's
        self.scale = attention.score_scale(self.cfg, head_dim)

    def function(self, mode: str, blocks: dict | None):
        """(q, k, v, cotangent, segments) -> ``forward``: the output; ``step``: it and the
        q, k, v gradients for the cotangent. ``blocks`` None: the XLA path."""
        cfg = self.cfg

        def fn(q, k, v, segments):
            if blocks is None:
                return attention.xla_mix(cfg, q, k, v, attention.segment_mask(segments))
            return tpu_attention.splash_mix(
                cfg, q, k, v, segments, None, scale=self.scale, blocks=blocks,
                interpret=self.interpret,
            )  # fmt: skip

        def run(q, k, v, cotangent, segments):
            if mode == "forward":
                return fn(q, k, v, segments)
            out, vjp = jax.vjp(lambda q, k, v: fn(q, k, v, segments), q, k, v)
            return out, vjp(cotangent)

        return run

    def time_all(self, programs: list[tuple[str, dict | None]]) -> None:
        """Compile the programs not timed yet together, then time each (median ms over
        ``--rounds`` calls after one untimed call); a failure (memory) is recorded."""
        todo = [p for p in dict.fromkeys(key(m, b) for m, b in programs) if p not in self.timed]
        lowered = {}
        for program in todo:
            mode, blocks = unkey(program)
            try:
                lowered[program] = jax.jit(self.function(mode, blocks)).lower(*self.operands)
            except Exception as exc:  # noqa: BLE001 - a shape a kernel refuses: recorded
                self.timed[program] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
        threads = concurrent.futures.ThreadPoolExecutor(self.args.compile_threads)
        with threads:
            compiled = dict(
                zip(lowered, threads.map(compile_or_error, lowered.values()), strict=True)
            )
        for program, executable in compiled.items():
            if isinstance(executable, str):
                self.timed[program] = {"error": executable}
                continue
            result = measure(executable, self.operands, self.args.rounds)
            out = result.pop("out", None)
            if out is not None and self.reference is None and program[0] == "step":
                # the XLA path's output and gradients, timed first; else the baseline's
                self.reference, self.reference_name = out, "xla" if program[1] is None else "splash"
            if out is not None and self.reference is not None:
                theirs = self.reference if program[0] == "step" else self.reference[0]
                result[f"max_abs_vs_{self.reference_name}"] = max_abs(out, theirs)
            self.timed[program] = result

    def ms(self, mode: str, blocks: dict | None) -> float | None:
        return self.timed[key(mode, blocks)].get("ms")


def key(mode: str, blocks: dict | None):
    return (mode, None if blocks is None else tuple(sorted(blocks.items())))


def unkey(program):
    mode, blocks = program
    return mode, None if blocks is None else dict(blocks)


def compile_or_error(lowered):
    try:
        return lowered.compile()
    except Exception as exc:  # noqa: BLE001 - out of memory (the XLA path's long rows)
        return f"{type(exc).__name__}: {exc}"[:300]


def measure(executable, operands, rounds: int) -> dict:
    try:
        out = jax.block_until_ready(executable(*operands))  # warm up
        times = []
        for _ in range(rounds):
            start = time.perf_counter()
            jax.block_until_ready(executable(*operands))
            times.append(time.perf_counter() - start)
    except Exception as exc:  # noqa: BLE001 - out of memory at run time
        return {"error": f"{type(exc).__name__}: {exc}"[:300]}
    return {"ms": 1e3 * statistics.median(times), "out": out}


def max_abs(ours, theirs) -> float:
    """The largest distance of any output or gradient from the reference's."""
    pairs = zip(jax.tree.leaves(ours), jax.tree.leaves(theirs), strict=True)
    return max(float(jnp.max(jnp.abs(a.astype(F32) - b.astype(F32)))) for a, b in pairs)


# ------------------------------------------------------------------------------ the sweep


def mode_of(kernel: str) -> str:
    """The forward kernel is timed alone; a backward kernel in forward and backward."""
    return "forward" if kernel == "forward" else "step"


def sweep_shape(args, seq_len: int, head_dim: int, interpret: bool) -> dict:
    """One shape's two rounds (the XLA path and the baseline compiled with the first), its
    best joined and timed against them: three waves of compiles."""
    started = time.perf_counter()
    shape = Shape(args, seq_len, head_dim, interpret)
    candidates = sorted({c for c in [*args.candidates, args.held] if seq_len % c == 0})
    base = held(seq_len, args.held)
    out = {"seq_len": seq_len, "head_dim": head_dim, "heads": shape.cfg.n_heads}
    out.update(rows=shape.rows, candidates=candidates, held=base)
    print(f"T={seq_len} K={head_dim} ({shape.rows} rows, {shape.cfg.n_heads} heads)")
    runs, failed = [], []
    for wave in (1, 2):
        plan = (first_round if wave == 1 else second_round)(seq_len, base, candidates, runs)
        extra = [("step", None), ("step", base), ("forward", base)] if wave == 1 else []
        shape.time_all(extra + [(mode_of(kernel), blocks) for kernel, blocks in plan])
        if wave == 1:
            out["xla"] = shape.timed[key("step", None)]
            out["baseline"] = {m: shape.ms(m, base) for m in ("forward", "step")}
            print(f"  xla {out['xla']}, all {args.held}: {out['baseline']} ms")
        for kernel, blocks in plan:
            timed = shape.timed[key(mode_of(kernel), blocks)]
            if any(r["kernel"] == kernel and r["blocks"] == blocks for r in runs):
                continue  # timed in the first round
            (runs if "ms" in timed else failed).append(
                {"kernel": kernel, "blocks": blocks, **timed}
            )
            if "ms" in timed:
                say_run(runs[-1], out["baseline"][mode_of(kernel)])
    best = joined(runs)
    shape.time_all([("step", best)])
    # the kernels' fastest joined can lose to every block at ``--held`` (each kernel was timed
    # with the others held): the table takes whichever of the two steps is faster
    contenders = [(best, shape.timed[key("step", best)]), (base, shape.timed[key("step", base)])]
    timed = [(blocks, result) for blocks, result in contenders if "ms" in result]
    if not timed:
        raise RuntimeError(f"neither the joined blocks nor all {args.held} ran: "
                           f"{shape.timed[key('step', best)]}")  # fmt: skip
    blocks, result = min(timed, key=lambda pair: pair[1]["ms"])
    out["joined"] = {"blocks": best, **shape.timed[key("step", best)]}
    out["best"] = {"blocks": blocks, "from": "joined" if blocks == best else "held", **result}
    step_ms, xla_ms = out["best"]["ms"], out["xla"].get("ms")
    held_ms = out["baseline"]["step"]
    out["best"]["baseline_over"] = held_ms / step_ms if held_ms else None
    out["best"]["xla_over"] = xla_ms / step_ms if xla_ms else None
    print(f"  best {best}: {step_ms:.2f} ms; all {args.held} / best "
          f"{out['best']['baseline_over']}, xla / best {out['best']['xla_over']}")  # fmt: skip
    out.update(runs=runs, failed=failed, programs=len(shape.timed), complete=True)
    out["seconds"] = time.perf_counter() - started
    return out


def held_where_faster(shape: dict) -> dict:
    """A shape a sweep before ``joined`` was recorded took its joined blocks whatever their
    time: here, as :func:`sweep_shape` does now, every block held where that step was faster
    (both were timed in its run)."""
    if not shape.get("complete") or "joined" in shape:
        return shape
    joined, held_ms = shape["best"], shape.get("baseline", {}).get("step")
    shape = {**shape, "joined": joined}
    if held_ms and held_ms < joined["ms"]:
        shape["best"] = {"blocks": shape["held"], "from": "held", "ms": held_ms,
                         "baseline_over": 1.0, "xla_over": joined["xla_over"] * joined["ms"]
                         / held_ms if joined.get("xla_over") else None}  # fmt: skip
    return shape


def say_run(run: dict, baseline_ms: float) -> None:
    fields = [name for name in KERNELS[run["kernel"]] if name]
    sizes = " ".join(f"{name} {run['blocks'][name]}" for name in fields)
    ratio = f"{baseline_ms / run['ms']:5.2f}" if baseline_ms else "-"
    print(f"  {run['kernel']:>7} {sizes}: {run['ms']:8.2f} ms, baseline / this {ratio}")


def sweep(args, interpret: bool, previous: dict | None = None, write=None) -> dict:
    """Every shape of ``args.shapes`` not complete in ``previous``, while the budget has
    room for another as long as the longest so far; ``write`` gets the report after each."""
    started = time.perf_counter()
    report = {"format": FORMAT, "jax": jax.__version__, "device": jax.devices()[0].device_kind}
    report.update(args={k: v for k, v in vars(args).items() if k != "resume"}, shapes=[])
    done = {(s["seq_len"], s["head_dim"]): s for s in (previous or {}).get("shapes", [])}
    done = {shape: held_where_faster(entry) for shape, entry in done.items()}
    longest = 0.0
    for text in args.shapes:
        seq_len, head_dim = shape_of(text)
        if done.get((seq_len, head_dim), {}).get("complete"):
            report["shapes"].append(done[(seq_len, head_dim)])
            continue
        elapsed = time.perf_counter() - started
        if longest and elapsed + 1.5 * longest > args.budget_s:
            print(f"T={seq_len} K={head_dim}: skipped, {elapsed:.0f} s of {args.budget_s}")
            entry = {"seq_len": seq_len, "head_dim": head_dim, "complete": False}
            report["shapes"].append({**entry, "skipped": "budget"})
            continue
        try:
            shape = sweep_shape(args, seq_len, head_dim, interpret)
        except Exception as exc:  # noqa: BLE001 - recorded; the next shape still runs
            shape = {"seq_len": seq_len, "head_dim": head_dim, "complete": False}
            shape["error"] = f"{type(exc).__name__}: {exc}"[:500]
            print(f"T={seq_len} K={head_dim}: {shape['error']}")
        longest = max(longest, time.perf_counter() - started - elapsed)
        report["shapes"].append(shape)
        report["best"] = table(report["shapes"])
        if write:
            write(report)
    report["best"] = table(report["shapes"])
    report["seconds"] = time.perf_counter() - started
    return report


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", nargs="+", default=SHAPES, help="ROWLENxHEADWIDTH ...")
    parser.add_argument("--tokens", type=int, default=16384, help="a call's tokens (all rows)")
    parser.add_argument("--d-model", type=int, default=1024, help="heads x head width")
    parser.add_argument("--segments", type=int, default=6, help="segments a row")
    parser.add_argument(
        "--dtype",
        default="bfloat16",
        choices=("bfloat16", "float32"),
        help="float32: in the interpreter only (splash's FP32 is refused on a TPU)",
    )
    parser.add_argument("--candidates", type=int, nargs="+", default=list(CANDIDATES))
    parser.add_argument("--held", type=int, default=HELD, help="every block not swept")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--compile-threads", type=int, default=min(12, os.cpu_count() or 1))
    parser.add_argument("--budget-s", type=float, default=300.0)
    parser.add_argument("--resume", help="a previous run's JSON: keep its complete shapes")
    parser.add_argument("--tiny", action="store_true", help="CPU smoke check: interpreter")
    parser.add_argument("--out", help="write the figures as JSON here (after every shape)")
    args = parser.parse_args(argv)
    backend = jax.default_backend()
    if args.tiny:  # tiny sizes where the command line left the defaults
        vars(args).update({k: v for k, v in TINY.items() if vars(args)[k] == parser.get_default(k)})
    elif backend != "tpu":
        parser.error(f"splash attention runs on a TPU (this backend: {backend}); use --tiny")
    print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}, {vars(args)}")
    previous = None
    if args.resume:
        with open(args.resume) as handle:
            previous = json.load(handle)

    def write(report):
        if args.out:
            with open(args.out, "w") as handle:
                json.dump(report, handle, indent=1)

    report = sweep(args, backend == "cpu", previous, write)
    write(report)
    print(f"best (splash_table.SPLASH_BLOCKS): {json.dumps(report['best'])}")
    return report


if __name__ == "__main__":
    main()
