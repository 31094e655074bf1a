"""grpo rollouts: ``minifield.rl.rollouts.sample_groups`` against a minimal JAX key/value-cache
sampling loop written here, at the same shapes, measured side by side in one run.

The model: Llama architecture at 2 layers, untied head. By default half Llama-3.2-1B's widths
(d_model 1024, 16 query / 8 key-value heads of 64, SwiGLU d_ff 4096) and a vocabulary of
32,000: at its own widths (``--d-model 2048 --heads 32 --kv-heads 8 --ffn 8192``, ``--vocab
128256``) one 128-token rollout of 16 rows takes 1–3 CPU-minutes on the project's 2-core
machine, too long to time several of each loop there. Its rotary base (500,000) and RMSNorm
epsilon (1e-5). Compute ``--dtype`` (BF16 by default: FP32 master weights, BF16 x BF16 ->
FP32 products, as minifield computes). The
rows: ``--prompts`` prompts of ``--prompt-len`` random tokens, ``--G`` completions of each
(16 rows by default), ``--new`` tokens each in a buffer of ``prompt-len + new`` slots (what
the grpo program passes as ``training.seq_len``), no stop token, so every row generates all
``--new`` tokens.

- **minifield**: ``sample_groups(..., sampling=Sampling(1.0, 0, 1.0))``, the recipe's defaults
  (temperature 1, no top-k, no nucleus), exactly as ``GRPOProgram.dispatch`` calls it, timed
  end to end (the host's row keys and buffer included).
- **minimal**: :func:`minimal.decode.minimal_generate`, plain ``jnp``: embed, RMSNorm, rotary, GQA
  attention against a ``[B, S, G, K]`` cache (key/value heads repeated), SwiGLU, head; the
  prompt through the model once, then a ``lax.fori_loop`` of one position per token, the
  cache written with ``dynamic_update_slice`` (every row at the same slot), the token drawn
  by ``jax.random.categorical`` from ``logits / temperature`` with one key per step; the
  parameters cast to the compute dtype once before the loop.

Both are compiled (one untimed call each), then timed ``--repeats`` times, interleaved so a
busy machine slows both alike; printed: min and median seconds (wall and process CPU) and
the ratio minifield / minimal of each (goal <= 1.1). Cross-check: both decode greedily at the
same parameters and must produce the same tokens (printed; a difference exits 1).

    .venv/bin/python benchmarks/grpo_rollouts.py [--repeats 5] [--no-check | --check-only]
        [--vocab 32000 --d-model 1024 --heads 16 --kv-heads 8 --ffn 4096 --dtype bfloat16]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from minimal.decode import EPS, THETA, Heads, minimal_generate  # noqa: E402

from minifield.models import llama  # noqa: E402
from minifield.models.sampling import Sampling  # noqa: E402
from minifield.rl import rollouts  # noqa: E402


def config(args) -> llama.LlamaConfig:
    return llama.LlamaConfig(
        vocab_size=args.vocab,
        d_model=args.d_model,
        n_layers=args.layers,
        n_heads=args.heads,
        n_kv_heads=args.kv_heads,
        d_ff=args.ffn,
        max_len=args.prompt_len + args.new,
        rope_theta=THETA,
        norm_eps=EPS,
        compute_dtype=args.dtype,
    )


# ----------------------------------------------------------------------------- the benchmark


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The model's shape, the rows and the timing (``grpo_update.py`` takes the same)."""
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--d-model", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--ffn", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--prompts", type=int, default=2)
    parser.add_argument("--G", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--new", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    check = parser.add_mutually_exclusive_group()
    check.add_argument("--no-check", action="store_true", help="skip the greedy cross-check")
    check.add_argument("--check-only", action="store_true", help="the greedy cross-check alone")
    args = parser.parse_args()

    cfg = config(args)
    started = time.perf_counter()
    params = jax.block_until_ready(
        jax.jit(llama.init_params, static_argnums=0)(cfg, jax.random.key(0))
    )
    init_s = time.perf_counter() - started
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, args.vocab, args.prompt_len).tolist() for _ in range(args.prompts)]
    prompt_index = np.arange(args.prompts) + 100
    rows = np.asarray([p for p in prompts for _ in range(args.G)], np.int32)
    length = args.prompt_len + args.new
    sampling = Sampling(1.0, 0, 1.0)

    def ours(greedy=False):
        made = rollouts.sample_groups(
            params, cfg, prompts, prompt_index, args.G, max_new=args.new, stops=(),
            sampling=None if greedy else sampling, seed=3, update=5, length=length,
        )  # fmt: skip
        return np.asarray(made.completion_ids)

    key = jax.random.key(3)
    heads = Heads(cfg.n_heads, cfg.n_kv_heads, cfg.head_dim)

    def minimal(greedy=False):
        temperature = None if greedy else sampling.temperature
        out = minimal_generate(
            params, heads, jnp.asarray(rows), key, args.new, temperature, args.dtype
        )
        return np.asarray(out)

    if not args.check_only:
        measure(args, cfg, init_s, {"minifield": ours, "minimal": minimal})
    if not args.no_check:
        cross_check(ours, minimal)


def measure(args, cfg, init_s, calls) -> None:
    """Each call compiled (one untimed call), then timed interleaved; the figures printed."""
    rows, length = args.prompts * args.G, args.prompt_len + args.new
    wall = {name: [] for name in calls}
    cpu = {name: [] for name in calls}
    compile_s = {}
    for name, call in calls.items():  # compile (and run once), untimed
        start = time.perf_counter()
        out = call()
        compile_s[name] = time.perf_counter() - start
        assert out.shape == (rows, args.new), (name, out.shape)
    load_before = os.getloadavg()[0]
    for r in range(args.repeats):
        for name in list(calls)[:: 1 if r % 2 == 0 else -1]:  # alternate who goes first
            start, start_cpu = time.perf_counter(), time.process_time()
            calls[name]()
            wall[name].append(time.perf_counter() - start)
            cpu[name].append(time.process_time() - start_cpu)
    load_after = os.getloadavg()[0]

    print(
        f"llama d{cfg.d_model} L{cfg.n_layers} GQA {cfg.n_heads}/{cfg.n_kv_heads} head_dim "
        f"{cfg.head_dim} ffn {cfg.d_ff} "
        f"vocab {args.vocab}, compute {args.dtype}; {rows} rows ({args.prompts} prompts "
        f"x G {args.G}), prompt {args.prompt_len} + {args.new} new tokens (buffer {length}), "
        f"temperature 1, no stop token; {jax.device_count()} {jax.default_backend()} "
        f"device(s); load average {load_before:.1f} -> {load_after:.1f}; params init "
        f"{init_s:.1f} s"
    )
    for name in calls:
        w, c = wall[name], cpu[name]
        print(
            f"{name:>10}: wall min {min(w):7.2f} s  median {statistics.median(w):7.2f} s   "
            f"CPU min {min(c):7.2f} s  median {statistics.median(c):7.2f} s   "
            f"(first call with compile {compile_s[name]:.1f} s)"
        )
    for label, t in (("wall", wall), ("CPU", cpu)):
        by_min = min(t["minifield"]) / min(t["minimal"])
        by_median = statistics.median(t["minifield"]) / statistics.median(t["minimal"])
        print(
            f"minifield / minimal ({label}): min {by_min:.3f}  median {by_median:.3f} (goal <= 1.1)"
        )


def cross_check(ours, minimal) -> None:
    """Both loops' greedy tokens at the same parameters: equal, or exit 1."""
    greedy_ours, greedy_minimal = ours(greedy=True), minimal(greedy=True)
    same = greedy_ours == greedy_minimal
    print(f"greedy cross-check: {int(same.sum())} / {same.size} tokens equal")
    if not same.all():
        first = [int(np.argmin(row)) if not row.all() else None for row in same]
        print(f"first differing token per row (None: identical): {first}")
        raise SystemExit("the minimal loop's greedy tokens differ from minifield's")


if __name__ == "__main__":
    main()
