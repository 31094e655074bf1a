"""Matrix-multiply peak of this machine for the dtypes the model uses.

Variants are interleaved round-robin within each size, so their ratios come from the
same time window (shared machines drift). Reports the median and best GFLOP/s
(2 n^3 / seconds) for:

- ``f32``        FP32 x FP32 -> FP32
- ``bf16``       BF16 x BF16 -> BF16 (plain cast; XLA:CPU upcasts it)
- ``bf16_f32acc`` BF16 x BF16 -> FP32 (``preferred_element_type``; the form the model uses)
- ``f32_highest`` FP32 x FP32 -> FP32 at ``Precision.HIGHEST`` (the model's FP32 compute: on a
  TPU the plain ``f32`` is one BF16 pass, docs/tpu.md#fp32-means-fp32)

Usage: uv run python benchmarks/bench_matmul.py [--sizes 512 1024 2048] [--reps 7] [--quick]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np


def _matmuls():
    plain = jax.jit(lambda a, b: a @ b)
    accumulate = jax.jit(lambda a, b: jnp.matmul(a, b, preferred_element_type=jnp.float32))
    highest = jax.jit(lambda a, b: jnp.matmul(a, b, precision=jax.lax.Precision.HIGHEST))
    return plain, accumulate, highest


def operands(n: int):
    rng = np.random.default_rng(0)
    a32 = jnp.asarray(rng.standard_normal((n, n), dtype=np.float32))
    b32 = jnp.asarray(rng.standard_normal((n, n), dtype=np.float32))
    return a32, b32, a32.astype(jnp.bfloat16), b32.astype(jnp.bfloat16)


def variants(n: int) -> dict:
    plain, accumulate, highest = _matmuls()
    a32, b32, a16, b16 = operands(n)
    return {
        "f32": lambda: plain(a32, b32).block_until_ready(),
        "bf16": lambda: plain(a16, b16).block_until_ready(),
        "bf16_f32acc": lambda: accumulate(a16, b16).block_until_ready(),
        "f32_highest": lambda: highest(a32, b32).block_until_ready(),
    }


def peak_probe(n: int = 2048, tries: int = 3):
    """A function returning {"f32", "bf16_f32acc"} GFLOP/s, best of ``tries`` calls each."""
    fns = variants(n)
    fns = {k: fns[k] for k in ("f32", "bf16_f32acc")}
    for fn in fns.values():
        fn()
    flops = 2.0 * n**3

    def probe() -> dict[str, float]:
        out = {}
        for name, fn in fns.items():
            best = float("inf")
            for _ in range(tries):
                t0 = time.perf_counter()
                fn()
                best = min(best, time.perf_counter() - t0)
            out[name] = flops / best / 1e9
        return out

    return probe


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[512, 1024, 2048])
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--quick", action="store_true", help="sizes 1024 2048, 3 repetitions")
    args = ap.parse_args()
    if args.quick:
        args.sizes, args.reps = [1024, 2048], 3
    print(
        f"jax {jax.__version__} backend={jax.default_backend()} devices={jax.devices()} "
        f"cpus={os.cpu_count()} loadavg={os.getloadavg()[0]:.2f}"
    )
    for n in args.sizes:
        fns = variants(n)
        repeat = {}
        for name, fn in fns.items():  # compile, warm, and size a timed batch to >= ~40 ms
            fn()
            t0 = time.perf_counter()
            fn()
            repeat[name] = max(1, int(0.04 / max(time.perf_counter() - t0, 1e-6)))
        times = {name: [] for name in fns}
        for _ in range(args.reps):
            for name, fn in fns.items():
                t0 = time.perf_counter()
                for _ in range(repeat[name]):
                    fn()
                times[name].append((time.perf_counter() - t0) / repeat[name])
        flops = 2.0 * n**3
        base = flops / statistics.median(times["f32"]) / 1e9
        for name, ts in times.items():
            median = flops / statistics.median(ts) / 1e9
            best = flops / min(ts) / 1e9
            print(
                f"n={n:5d} {name:12s} median {median:8.1f} GFLOP/s  best {best:8.1f} GFLOP/s  "
                f"(x{median / base:4.2f} of f32)"
            )


if __name__ == "__main__":
    main()
