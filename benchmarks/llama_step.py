"""Llama train-step benchmark: the project's packed-SFT step against a minimal JAX+optax loop.

The model: Llama architecture, d512, 8 layers, GQA 8 query / 2 key-value heads, SwiGLU d_ff
1408, vocabulary 8192, untied head, sequence 512, a batch of packed rows (several segments
per row, loss on half of each). Measured in one run, interleaved round by round so the
ratio comes from the same window on this shared machine:

- **ours**: ``LlamaConfig`` + ``optimizer.make_optimizer`` + ``sft_step.make_train_step``,
  jit-compiled once with the state donated, exactly as the worker runs it;
- **minimal**: the same model written from the equations in ``_llama_minimal.py`` (RMSNorm, rotary, GQA by
  repeating key/value heads, segment-restricted causal softmax, SwiGLU, cross-entropy on the
  counted targets) as one params dict, one loss, ``optax.chain(clip_by_global_norm,
  adamw(warmup+cosine))``, ``jax.jit`` with donation; in BF16 mode each product is BF16 x
  BF16 with FP32 accumulation in forward and backward (its own custom VJP), as ours.

Printed: median step time of each, ours / minimal (goal ≤ 1.05), per compute dtype.

    uv run --locked python benchmarks/llama_step.py [--batch 2] [--rounds 5] [--steps 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _llama_minimal as minimal  # noqa: E402

from minifield.strategies.packed_sft.llama import LlamaConfig  # noqa: E402
from minifield.strategies.packed_sft.optimizer import make_optimizer  # noqa: E402
from minifield.strategies.packed_sft.sft_step import init_train_state, make_train_step  # noqa: E402

D, LAYERS, HEADS, KV_HEADS, D_FF, VOCAB, SEQ = 512, 8, 8, 2, 1408, 8192, 512
THETA, EPS = 10000.0, 1e-6
MAX_STEPS = 1000
F32, BF16 = jnp.float32, jnp.bfloat16
SHAPE = minimal.Shape(D, LAYERS, HEADS, KV_HEADS, D_FF, VOCAB, THETA, EPS)


# ----------------------------------------------------------------------------- timing


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=3, help="timed steps per round")
    parser.add_argument("--dtypes", default="bfloat16,float32")
    args = parser.parse_args()
    batch = minimal.packed_batch(args.batch, SEQ, VOCAB)
    print(
        f"Llama d{D}, {LAYERS} layers, GQA {HEADS}/{KV_HEADS}, d_ff {D_FF}, vocab {VOCAB}, "
        f"seq {SEQ}, batch {args.batch}; {jax.device_count()} {jax.devices()[0].platform} "
        f"device(s); median of {args.rounds} rounds x {args.steps} steps"
    )
    for dtype in args.dtypes.split(","):
        cfg = LlamaConfig(
            vocab_size=VOCAB, d_model=D, n_layers=LAYERS, n_heads=HEADS, n_kv_heads=KV_HEADS,
            d_ff=D_FF, max_len=SEQ, rope_theta=THETA, norm_eps=EPS, compute_dtype=dtype,
        )  # fmt: skip
        optimizer = make_optimizer({}, MAX_STEPS)
        ours = jax.jit(make_train_step(cfg, optimizer), donate_argnums=(0,))
        state = init_train_state(cfg, optimizer, seed=0)
        mini, params, opt_state = minimal.make_step(
            SHAPE, BF16 if dtype == "bfloat16" else F32, MAX_STEPS
        )
        state, _ = ours(state, batch)  # compile
        jax.block_until_ready(state)
        params, opt_state, loss = mini(params, opt_state, batch)
        jax.block_until_ready(loss)
        times = {"ours": [], "minimal": []}
        for _ in range(args.rounds):
            start = time.perf_counter()
            for _ in range(args.steps):
                state, metrics = ours(state, batch)
            jax.block_until_ready(metrics)
            times["ours"].append((time.perf_counter() - start) / args.steps)
            start = time.perf_counter()
            for _ in range(args.steps):
                params, opt_state, loss = mini(params, opt_state, batch)
            jax.block_until_ready(loss)
            times["minimal"].append((time.perf_counter() - start) / args.steps)
        ours_s, mini_s = (statistics.median(times[k]) for k in ("ours", "minimal"))
        print(
            f"{dtype:>9}: ours {ours_s:.3f} s/step, minimal {mini_s:.3f} s/step -> "
            f"ours / minimal = {ours_s / mini_s:.3f} (goal <= 1.05); "
            f"rounds ours {[round(t, 3) for t in times['ours']]}, "
            f"minimal {[round(t, 3) for t in times['minimal']]}"
        )


if __name__ == "__main__":
    main()
