"""Llama train-step benchmark: the project's packed-SFT step against a minimal JAX+optax loop,
at several vocabularies (the byte vocabulary 260, 8192, Llama 3's 128,256).

The model: Llama architecture, d512, 8 layers, GQA 8 query / 2 key-value heads, SwiGLU d_ff
1408, untied head, sequence 512, a batch of packed rows (several segments per row, loss on half
of each); only the vocabulary changes between lines. Measured in one run, interleaved round by
round (the loop that goes first alternating) so each ratio comes from the same window on this
shared machine:

- **ours**: ``LlamaConfig`` + ``optimizer.make_optimizer`` + ``sft_step.make_train_step``,
  jit-compiled once with the state donated, exactly as the worker runs it;
- **minimal**: the same model written from the equations in ``minimal/llama.py`` (RMSNorm, rotary, GQA by
  repeating key/value heads, segment-restricted causal softmax, SwiGLU, cross-entropy on the
  counted targets) as one params dict, one loss, ``optax.chain(clip_by_global_norm,
  adamw(warmup+cosine))``, ``jax.jit`` with donation; in BF16 mode each product is BF16 x
  BF16 with FP32 accumulation in forward and backward (its own custom VJP), as ours.

Printed per vocabulary and compute dtype: median step time of each (wall and CPU time of the
process), ours / minimal (goal <= 1.05) as a ratio of the medians and as the median of each
round's ratio, the load average before and after, and what each
compiled step does over the vocabulary: the operations of its optimised HLO whose result has a
vocabulary-sized axis (head product, log-softmax, its gradient, the embedding's and head's
gradients and AdamW updates), counted by kind and shape, and whether the two loops' lists are
the same.

    uv run --locked python benchmarks/llama_step.py [--vocabs 260,8192,128256] [--batch 1]
        [--rounds 5] [--steps 2] [--dtypes bfloat16,float32]
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import statistics
import sys
import time
from pathlib import Path

import jax

sys.path.insert(0, str(Path(__file__).resolve().parent))
from minimal import llama as minimal  # noqa: E402

from minifield.models.llama import LlamaConfig  # noqa: E402
from minifield.training.optimizer import make_optimizer  # noqa: E402
from minifield.training.train_step import init_train_state, make_train_step  # noqa: E402

D, LAYERS, HEADS, KV_HEADS, D_FF, SEQ = 512, 8, 8, 2, 1408, 512
THETA, EPS = 10000.0, 1e-6
MAX_STEPS = 1000


def vocab_ops(hlo_text: str, vocab: int) -> collections.Counter:
    """``(op, result type)`` counts of the entry computation's instructions that produce or
    read an array with an axis of ``vocab`` elements (a reduction over the vocabulary counts
    by its operand; parameters and the output tuple left out)."""
    entry = hlo_text[hlo_text.index("ENTRY") :].splitlines()[1:]
    vocab_axis = re.compile(rf"\w+\[(?:[\d,]*,)?{vocab}(?:,[\d,]*)?\]")
    types, ops = {}, collections.Counter()
    for line in entry:
        m = re.match(r"\s*(?:ROOT )?(%\S+) = (\w+\[[\d,]*\]|\(.*?\))\S* ([\w-]+)\((.*?)\)", line)
        if not m:
            continue
        name, result, op, operands = m.groups()
        types[name] = result
        if op in ("parameter", "tuple"):
            continue
        read = (types.get(o, "") for o in re.findall(r"%[\w.-]+", operands))
        if vocab_axis.fullmatch(result) or any(vocab_axis.fullmatch(t) for t in read):
            kind = re.search(r"kind=(\w+)", line)
            ops[op + (f" {kind.group(1)}" if kind else ""), result] += 1
    return ops


def _loops(vocab: int, dtype: str, batch: dict):
    """``({"ours": run, "minimal": run}, {"ours": hlo, "minimal": hlo})``, each compiled (one
    step taken); ``run(n)`` takes ``n`` more steps and waits for them; ``hlo`` the optimised
    HLO text of the compiled step."""
    cfg = LlamaConfig(
        vocab_size=vocab, d_model=D, n_layers=LAYERS, n_heads=HEADS, n_kv_heads=KV_HEADS,
        d_ff=D_FF, max_len=SEQ, rope_theta=THETA, norm_eps=EPS, compute_dtype=dtype,
    )  # fmt: skip
    optimizer = make_optimizer({}, MAX_STEPS)
    state = init_train_state(cfg, optimizer, seed=0)
    ours = jax.jit(make_train_step(cfg, optimizer), donate_argnums=(0,)).lower(state, batch)
    ours = ours.compile()
    shape = minimal.Shape(D, LAYERS, HEADS, KV_HEADS, D_FF, vocab, THETA, EPS)
    mini, params, opt_state = minimal.make_step(shape, cfg.dtype, MAX_STEPS)
    mini = mini.lower(params, opt_state, batch).compile()
    held = {"ours": state, "minimal": (params, opt_state)}

    def run_ours(n: int) -> None:
        for _ in range(n):
            held["ours"], metrics = ours(held["ours"], batch)
        jax.block_until_ready(metrics)

    def run_minimal(n: int) -> None:
        params, opt_state = held["minimal"]
        for _ in range(n):
            params, opt_state, loss = mini(params, opt_state, batch)
        jax.block_until_ready(loss)
        held["minimal"] = (params, opt_state)

    run_ours(1)
    run_minimal(1)
    hlo = {"ours": ours.as_text(), "minimal": mini.as_text()}
    return {"ours": run_ours, "minimal": run_minimal}, hlo


def measure(vocab: int, dtype: str, batch_rows: int, rounds: int, steps: int) -> dict:
    """Per-step medians ``{(loop, "wall" | "cpu"): seconds}``, the two loops interleaved, each
    first in every other round (and ``"raw"``: every round's times; ``"ops"``:
    :func:`vocab_ops` of each loop)."""
    loops, hlo = _loops(vocab, dtype, minimal.packed_batch(batch_rows, SEQ, vocab))
    times = {(name, clock): [] for name in loops for clock in ("wall", "cpu")}
    for r in range(rounds):
        # which loop goes first alternates, so neither always follows the other's traffic
        for name in ("ours", "minimal") if r % 2 == 0 else ("minimal", "ours"):
            run = loops[name]
            wall, cpu = time.perf_counter(), time.process_time()
            run(steps)
            times[name, "wall"].append((time.perf_counter() - wall) / steps)
            times[name, "cpu"].append((time.process_time() - cpu) / steps)
    ops = {name: vocab_ops(text, vocab) for name, text in hlo.items()}
    return {key: statistics.median(values) for key, values in times.items()} | {
        "raw": times,
        "ops": ops,
    }


def round_ratio(raw: dict, clock: str) -> float:
    """Median over rounds of ours / minimal within the round (each pair ran back to back)."""
    pairs = zip(raw["ours", clock], raw["minimal", clock], strict=True)
    return statistics.median(o / m for o, m in pairs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vocabs", default="260,8192,128256")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=2, help="timed steps per round")
    parser.add_argument("--dtypes", default="bfloat16,float32")
    args = parser.parse_args()
    print(
        f"Llama d{D}, {LAYERS} layers, GQA {HEADS}/{KV_HEADS}, d_ff {D_FF}, seq {SEQ}, "
        f"batch {args.batch}; {jax.device_count()} {jax.devices()[0].platform} device(s), "
        f"{os.cpu_count()} cpus; median of {args.rounds} rounds x {args.steps} steps, "
        "interleaved"
    )
    for vocab in (int(v) for v in args.vocabs.split(",")):
        for dtype in args.dtypes.split(","):
            load = os.getloadavg()[0]
            m = measure(vocab, dtype, args.batch, args.rounds, args.steps)
            print(
                f"vocab {vocab:>6} {dtype:>8}: ours {m['ours', 'wall']:.3f} s/step, minimal "
                f"{m['minimal', 'wall']:.3f} s/step -> ours / minimal = "
                f"{m['ours', 'wall'] / m['minimal', 'wall']:.3f} wall, "
                f"{m['ours', 'cpu'] / m['minimal', 'cpu']:.3f} CPU time (goal <= 1.05); "
                f"median of the rounds' ratios {round_ratio(m['raw'], 'wall'):.3f} wall, "
                f"{round_ratio(m['raw'], 'cpu'):.3f} CPU time; "
                f"load {load:.2f} -> {os.getloadavg()[0]:.2f}; rounds ours "
                f"{[round(t, 3) for t in m['raw']['ours', 'wall']]}, minimal "
                f"{[round(t, 3) for t in m['raw']['minimal', 'wall']]}",
                flush=True,
            )
            same = "the same" if m["ops"]["ours"] == m["ops"]["minimal"] else "DIFFERENT"
            print(f"  ops over the vocabulary: {same} in both loops")
            for name, ops in m["ops"].items():
                listed = ", ".join(f"{n} {op} {ty}" for (op, ty), n in sorted(ops.items()))
                print(f"    {name}: {sum(ops.values())}: {listed}", flush=True)


if __name__ == "__main__":
    main()
