"""Splash attention's block sizes on the chip: a sweep, each against the XLA attention path.

The attention of ``model.attention: pallas`` with ``runtime.backend: tpu``
(``minifield.models.layers.tpu_attention``), forward and backward (the gradients of q, k and
v for one cotangent), over packed rows: causal, ``--segments`` segments a row of unequal
lengths, grouped-query heads where ``--kv-heads`` < ``--heads``. For every row length and
every pair of (query block, key block) sizes (the backward pass's dq and dkv kernels take the
same pair, the compute blocks the key block) it prints the median milliseconds over
``--rounds`` calls and the XLA path's time ÷ splash's; the XLA path (dense ``[B, H, T, T]``
scores) is timed once per row length, and each kernel's output is checked against it. The
fastest pair per row length is the candidate for ``execution.SPLASH_BLOCKS`` (the table's
sizes are splash's own defaults until this has run on the chip: ``docs/tpu.md``).

On the chip (the issue's attention shape: 8 rows, 16 heads of 128, BF16, 2048 and 4096):

    python benchmarks/splash_blocks.py --out splash_blocks.json

On CPU, a smoke check at tiny sizes in Pallas's interpreter (its times say nothing about
the chip):

    uv run python benchmarks/splash_blocks.py --tiny
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from minifield.models import execution
from minifield.models.layers import attention, tpu_attention
from minifield.models.llama import LlamaConfig

TINY = dict(seq_lens=[256], batch=1, heads=2, kv_heads=1, head_dim=128, blocks=[128, 256])


def config(args, seq_len: int) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=256,
        d_model=args.heads * args.head_dim,
        n_layers=1,
        n_heads=args.heads,
        n_kv_heads=args.kv_heads,
        head_dim=args.head_dim,
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


def forward_backward(fn, cotangent):
    """A compiled (q, k, v) -> (output, its q, k, v gradients for ``cotangent``)."""

    def run(q, k, v):
        out, vjp = jax.vjp(fn, q, k, v)
        return out, vjp(cotangent)

    return jax.jit(run)


def median_ms(step, qkv, rounds: int) -> tuple[float, tuple]:
    result = jax.block_until_ready(step(*qkv))  # compile and warm up
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        jax.block_until_ready(step(*qkv))
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times), result


def sweep(args, seq_len: int, interpret: bool) -> dict:
    cfg = config(args, seq_len)
    qkv, cotangent, segments = inputs(cfg, args.batch, seq_len, args.segments)
    mask = attention.segment_mask(segments)
    xla = forward_backward(lambda q, k, v: attention.xla_mix(cfg, q, k, v, mask), cotangent)
    xla_ms, (xla_out, _) = median_ms(xla, qkv, args.rounds)
    print(f"T={seq_len}: xla {xla_ms:.2f} ms")
    scale = attention.score_scale(cfg, cfg.head_dim)
    rows = []
    for block_q, block_kv in itertools.product(args.blocks, repeat=2):
        asked = {"block_q": block_q, "block_kv": block_kv, "block_kv_compute": block_kv}
        asked.update(block_q_dkv=block_q, block_kv_dkv=block_kv, block_kv_dkv_compute=block_kv)
        asked.update(block_q_dq=block_q, block_kv_dq=block_kv)
        blocks = execution.splash_blocks(seq_len, asked)
        if blocks != asked:
            continue  # a size the row cannot take: fitted to another pair the sweep has
        step = forward_backward(
            lambda q, k, v, blocks=blocks: tpu_attention.splash_mix(
                cfg, q, k, v, segments, None, scale=scale, blocks=blocks, interpret=interpret
            ),
            cotangent,
        )
        ms, (out, _) = median_ms(step, qkv, args.rounds)
        error = float(jnp.max(jnp.abs(out.astype(jnp.float32) - xla_out.astype(jnp.float32))))
        rows.append({"block_q": block_q, "block_kv": block_kv, "ms": ms, "xla_over": xla_ms / ms})
        rows[-1]["max_abs_vs_xla"] = error
        print(
            f"  blocks q {block_q:5d} kv {block_kv:5d}: {ms:8.2f} ms, xla/splash "
            f"{xla_ms / ms:5.2f}, max |splash - xla| {error:.2e}"
        )
    best = min(rows, key=lambda row: row["ms"])
    print(f"  fastest: q {best['block_q']} kv {best['block_kv']} ({best['xla_over']:.2f}x xla)")
    return {"seq_len": seq_len, "xla_ms": xla_ms, "splash": rows, "fastest": best}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[2048, 4096])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=16)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--segments", type=int, default=6, help="segments a row")
    parser.add_argument(
        "--dtype",
        default="bfloat16",
        choices=("bfloat16", "float32"),
        help="float32: in the interpreter only (splash's FP32 is refused on a TPU)",
    )
    parser.add_argument("--blocks", type=int, nargs="+", default=[128, 256, 512, 1024])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--tiny", action="store_true", help="CPU smoke check: interpreter")
    parser.add_argument("--out", help="write the figures as JSON here")
    args = parser.parse_args()
    backend = jax.default_backend()
    if args.tiny:
        vars(args).update(TINY, rounds=1)
    elif backend != "tpu":
        parser.error(f"splash attention runs on a TPU (this backend: {backend}); use --tiny")
    print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}, {vars(args)}")
    report = {"jax": jax.__version__, "device": jax.devices()[0].device_kind, "args": vars(args)}
    report["sweeps"] = [sweep(args, T, interpret=backend == "cpu") for T in args.seq_lens]
    if args.out:
        with open(args.out, "w") as handle:
            json.dump(report, handle, indent=1)


if __name__ == "__main__":
    main()
