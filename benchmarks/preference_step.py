"""A preference update ÷ a supervised update on the same answer tokens, and the reference
pass ÷ one forward over the same tokens, measured side by side in one run.

The model: Llama architecture (``--d-model``, ``--layers``, GQA, vocabulary ``--vocab``).
The rows: random pairs (a prompt of seq/16 to seq/8 tokens, two answers of seq/12 to seq/4) packed two segments
per pair into ``--batch`` rows of ``--seq`` slots by :func:`minifield.strategies.preference.pairs.pack`.

- **preference**: ``sft_step.make_train_step`` with the preference objective (DPO, reference
  log-probabilities given), exactly as :class:`PreferenceProgram` builds it;
- **sft**: ``sft_step.make_train_step`` with the supervised loss on the *same rows*: the same
  tokens, segments and answer-token mask (so the same answer tokens are trained);
- **reference**: ``logprobs.answer_logps`` jitted (what ``minifield reference-logprobs``
  runs per batch);
- **forward**: ``model.forward`` (the logits) over the same rows.

Each is compiled and run once untimed, then timed over ``--steps`` calls, interleaved in
rounds so a busy machine slows all alike; the medians and the ratios are printed
(goals: preference / sft ≤ 2.2, reference / forward ≤ 1.1).

    uv run --locked python benchmarks/preference_step.py [--d-model 256 --layers 4 --seq 256]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _llama_shape  # noqa: E402

from minifield.data.packing import Rows  # noqa: E402
from minifield.models import model
from minifield.strategies.preference import logprobs, losses, pairs  # noqa: E402
from minifield.strategies.preference.program import make_objective  # noqa: E402
from minifield.training import optimizer, train_step  # noqa: E402


def _rows(args) -> pairs.PairRows:
    rng = np.random.default_rng(0)
    made = []
    for _ in range(3 * args.batch):  # about two pairs fill a row: more than enough rows
        prompt = rng.integers(3, args.vocab, rng.integers(args.seq // 16, args.seq // 8))
        chosen, rejected = (
            rng.integers(3, args.vocab, rng.integers(args.seq // 12, args.seq // 4)).tolist()
            for _ in "ab"
        )
        prompt = prompt.tolist()
        made.append(pairs.EncodedPair(prompt, chosen, rejected))
    packed = pairs.pack(made, args.seq, "reject", 0)
    held = packed.rows.pair_index[: args.batch] >= 0
    return pairs.PairRows(
        *(v[: args.batch] for v in packed.rows[:5]),
        ref_chosen=np.where(held, -50.0, 0.0).astype(np.float32),
        ref_rejected=np.where(held, -60.0, 0.0).astype(np.float32),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    _llama_shape.add_step_arguments(parser)
    args = parser.parse_args()
    cfg = _llama_shape.config(args, args.seq)
    training = {"warmup_steps": 2, "learning_rate": 1e-4}
    opt = optimizer.make_optimizer(training, 1000)
    rows = jax.tree_util.tree_map(jnp.asarray, _rows(args))
    sft_rows = Rows(rows.tokens, rows.segments, rows.positions, rows.loss_mask)
    objective = make_objective(losses.LossSettings("dpo", beta=0.1))
    steps = {
        "preference": jax.jit(
            train_step.make_train_step(cfg, opt, objective=objective), donate_argnums=(0,)
        ),
        "sft": jax.jit(train_step.make_train_step(cfg, opt), donate_argnums=(0,)),
    }
    states = {name: train_step.init_train_state(cfg, opt, 0) for name in steps}
    params = train_step.init_train_state(cfg, opt, 0)["params"]
    reference = jax.jit(lambda p, b: logprobs.answer_logps(p, cfg, b))
    forward = jax.jit(lambda p, b: model.forward(p, cfg, b.tokens, b.segments, b.positions))
    calls = {
        "preference": lambda: steps["preference"](states["preference"], rows),
        "sft": lambda: steps["sft"](states["sft"], sft_rows),
        "reference": lambda: (states.get("x"), reference(params, rows)),
        "forward": lambda: (states.get("x"), forward(params, sft_rows)),
    }
    times: dict[str, list[float]] = {name: [] for name in calls}

    def run(name):
        start = time.perf_counter()
        state, out = calls[name]()
        if name in steps:
            states[name] = state
        jax.block_until_ready(out)
        return time.perf_counter() - start

    for name in calls:  # compile and run once, untimed
        run(name)
    for _ in range(args.rounds):
        for name in calls:
            times[name] += [run(name) for _ in range(args.steps)]
    median = {name: statistics.median(t) for name, t in times.items()}
    answer = int(np.asarray(rows.loss_mask).sum())
    n_pairs = int((np.asarray(rows.pair_index) >= 0).sum())
    print(
        f"llama d{args.d_model} L{args.layers} GQA {args.heads}/{args.kv_heads} vocab "
        f"{args.vocab}, {args.batch} rows x {args.seq}: {n_pairs} pairs, {answer} answer "
        f"tokens; compute {args.dtype}; {jax.device_count()} {jax.default_backend()} device(s)"
    )
    for name, seconds in median.items():
        print(f"{name:>10}: {seconds * 1e3:8.2f} ms")
    print(f"preference / sft update: {median['preference'] / median['sft']:.3f} (goal <= 2.2)")
    print(f"reference pass / forward: {median['reference'] / median['forward']:.3f} (goal <= 1.1)")


if __name__ == "__main__":
    main()
