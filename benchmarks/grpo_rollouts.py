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

Both loops must compute the same thing before their speed means anything, so the figures
are reported only with ``"agree": true`` (:func:`agreement`, first): both decode greedily
``--check-new`` tokens after the prompts at the same parameters in FP32 with every product
at ``Precision.HIGHEST``, and must produce the same tokens. In BF16 greedy tokens are no such
check: at random weights the top two logits of a 32,000-token vocabulary are often within
BF16's rounding of each other (on the chip 536 of 4,096 tokens equal), and a different
summation order flips them; FP32's rounding is 2^16 times finer. The BF16 tokens are
compared too and reported (``bf16_tokens_equal``), not judged. A disagreement exits 1
before anything is timed.

Then both are compiled (one untimed call each) and timed ``--repeats`` times, interleaved so
a busy machine slows both alike; printed: min and median seconds (wall and process CPU) and
the ratio minifield / minimal of each (goal <= 1.1); ``--out`` writes it all as JSON.

    .venv/bin/python benchmarks/grpo_rollouts.py [--repeats 5] [--check-only] [--out F]
        [--vocab 32000 --d-model 1024 --heads 16 --kv-heads 8 --ffn 4096 --dtype bfloat16]
    uv run python benchmarks/grpo_rollouts.py --tiny     # CPU smoke check at tiny sizes
"""

from __future__ import annotations

import argparse
import dataclasses
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


TINY = dict(vocab=256, d_model=64, heads=4, kv_heads=2, ffn=128, prompts=2, G=2)
TINY.update(prompt_len=8, new=8, check_new=8, repeats=1)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    parser.add_argument("--check-new", type=int, default=16, help="tokens the check decodes")
    parser.add_argument("--check-only", action="store_true", help="the agreement check alone")
    parser.add_argument("--tiny", action="store_true", help="CPU smoke check: tiny sizes")
    parser.add_argument("--out", help="write the check and the figures as JSON here")
    args = parser.parse_args(argv)
    if args.tiny:  # tiny sizes where the command line left the defaults
        vars(args).update({k: v for k, v in TINY.items() if vars(args)[k] == parser.get_default(k)})

    cfg = config(args)
    started = time.perf_counter()
    params = jax.block_until_ready(
        jax.jit(llama.init_params, static_argnums=0)(cfg, jax.random.key(0))
    )
    init_s = time.perf_counter() - started
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, args.vocab, args.prompt_len).tolist() for _ in range(args.prompts)]
    loops = Loops(args, params, prompts)
    report = {"args": vars(args), "backend": jax.default_backend(), **agreement(args, loops)}
    write(args.out, report)
    if not report["agree"]:
        raise SystemExit("the minimal loop's greedy tokens differ from minifield's in FP32")
    if not args.check_only:
        calls = {"minifield": loops.ours, "minimal": loops.minimal}
        report["speed"] = measure(args, config(args), init_s, calls)
        write(args.out, report)
    return report


class Loops:
    """Both loops at the same parameters and rows: ``ours`` and ``minimal``, sampling at the
    recipe's defaults or greedy, in a compute dtype and for a number of new tokens."""

    def __init__(self, args, params, prompts):
        self.args, self.params, self.prompts = args, params, prompts
        self.rows = np.asarray([p for p in prompts for _ in range(args.G)], np.int32)

    def ours(self, greedy=False, dtype=None, new=None):
        args = self.args
        cfg = (
            config(args)
            if dtype is None
            else dataclasses.replace(config(args), compute_dtype=dtype)
        )
        new = new or args.new
        made = rollouts.sample_groups(
            self.params, cfg, self.prompts, np.arange(args.prompts) + 100, args.G, max_new=new,
            stops=(), sampling=None if greedy else Sampling(1.0, 0, 1.0), seed=3, update=5,
            length=args.prompt_len + new,
        )  # fmt: skip
        return np.asarray(made.completion_ids)[:, :new]

    def minimal(self, greedy=False, dtype=None, new=None):
        cfg = config(self.args)
        heads = Heads(cfg.n_heads, cfg.n_kv_heads, cfg.head_dim)
        out = minimal_generate(
            self.params, heads, jnp.asarray(self.rows), jax.random.key(3), new or self.args.new,
            None if greedy else 1.0, dtype or self.args.dtype,
        )  # fmt: skip
        return np.asarray(out)


def agreement(args, loops: Loops) -> dict:
    """The two loops' greedy tokens in FP32 at ``HIGHEST`` (the verdict) and in the compute
    dtype (reported): ``agree``, each comparison's counts and each row's first difference."""
    with jax.default_matmul_precision("highest"):
        fp32 = compare(loops, "float32", args.check_new)
    out = {"agree": fp32["tokens_equal"] == fp32["tokens"], "fp32_highest": fp32}
    if args.dtype != "float32":
        out[f"{args.dtype}_greedy"] = compare(loops, args.dtype, args.new)
    print(f"agreement: {json.dumps(out)}")
    return out


def compare(loops: Loops, dtype: str, new: int) -> dict:
    ours = loops.ours(greedy=True, dtype=dtype, new=new)
    minimal = loops.minimal(greedy=True, dtype=dtype, new=new)
    same = ours == minimal
    first = [int(np.argmin(row)) if not row.all() else None for row in same]
    return {"tokens_equal": int(same.sum()), "tokens": int(same.size), "first_difference": first}


def write(path, report) -> None:
    if path:
        with open(path, "w") as handle:
            json.dump(report, handle, indent=1)


def measure(args, cfg, init_s, calls) -> dict:
    """Each call compiled (one untimed call), then timed interleaved; the figures printed
    and returned (seconds per call, the ratios), after the loops were found to agree."""
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
    ratios = {}
    for label, t in (("wall", wall), ("CPU", cpu)):
        if (
            min(t["minimal"]) <= 0
        ):  # on an accelerator a call's host CPU can be below the clock's tick
            ratios[label.lower()] = None
            print(f"minifield / minimal ({label}): not resolved (a call took no measurable time)")
            continue
        by_min = min(t["minifield"]) / min(t["minimal"])
        by_median = statistics.median(t["minifield"]) / statistics.median(t["minimal"])
        ratios[label.lower()] = {"min": by_min, "median": by_median}
        print(
            f"minifield / minimal ({label}): min {by_min:.3f}  median {by_median:.3f} "
            "(goal <= 1.1; the loops agree in FP32)"
        )
    return {"wall_s": wall, "cpu_s": cpu, "compile_s": compile_s, "minifield_over_minimal": ratios}


if __name__ == "__main__":
    main()
