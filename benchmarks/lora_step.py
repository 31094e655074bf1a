"""LoRA train step ÷ full fine-tuning train step on the same Llama-architecture model.

Both are the strategy's own steps (``sft_step.make_train_step`` for full fine-tuning,
``lora.make_train_step`` for LoRA, the recipe's AdamW with clipping), jitted with the state
donated, on the same random batch of packed rows. Each is compiled and run once untimed, then
timed over ``--steps`` updates, interleaved in rounds so a busy machine slows both alike; the
median per-update time of each is printed, with the ratio LoRA / full, the ratio of XLA's
FLOP counts of the two compiled updates and the trained parameter counts.

    uv run python benchmarks/lora_step.py [--d-model 256 --layers 4 --seq 256 --rank 8]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import jax
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _llama_shape  # noqa: E402

from minifield.data.packing import Rows  # noqa: E402
from minifield.models import llama
from minifield.training import lora, optimizer, train_step  # noqa: E402

ALL_TARGETS = tuple(name for name, dense in lora.TARGETS.items() if dense)  # a dense model's


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    _llama_shape.add_step_arguments(parser)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--targets", default=",".join(ALL_TARGETS))
    parser.add_argument("--base-dtype", default="float32", choices=("float32", "bfloat16"))
    args = parser.parse_args()

    cfg = _llama_shape.config(args, args.seq)
    settings = lora.LoraSettings(
        args.rank, float(2 * args.rank), tuple(args.targets.split(",")), args.base_dtype
    )
    training = {"warmup_steps": 2, "learning_rate": 1e-3}
    max_steps = 1000
    opt = optimizer.make_optimizer(training, max_steps)
    schedule = optimizer.make_schedule(training, max_steps)

    rng = np.random.default_rng(0)
    tokens = rng.integers(0, args.vocab, (args.batch, args.seq)).astype(np.int32)
    # two packed examples per row: segment-restricted attention as in training
    half = args.seq // 2
    segments = np.where(np.arange(args.seq) < half, 1, 2).astype(np.int32)
    positions = np.where(
        np.arange(args.seq) < half, np.arange(args.seq), np.arange(args.seq) - half
    )
    batch = Rows(
        tokens=tokens,
        segments=np.broadcast_to(segments, tokens.shape).copy(),
        positions=np.broadcast_to(positions.astype(np.int32), tokens.shape).copy(),
        loss_mask=np.ones(tokens.shape, np.float32),
    )

    full_state = train_step.init_train_state(cfg, opt, 0)
    full_step = jax.jit(train_step.make_train_step(cfg, opt, schedule), donate_argnums=(0,))
    base = jax.tree.map(
        lambda a: a.astype(args.base_dtype), llama.init_params(cfg, jax.random.key(1))
    )
    lora_state = lora.init_state(cfg, settings, opt, 0, np.zeros(32, np.uint8))
    lora_step = jax.jit(lora.make_train_step(cfg, settings, opt, schedule), donate_argnums=(0,))

    flops = {
        name: _flops(fn.lower(*example).compile())
        for name, fn, example in (
            ("full", full_step, (full_state, batch)),
            ("lora", lora_step, (lora_state, base, batch)),
        )
    }
    states = {"full": full_state, "lora": lora_state}
    steps = {"full": lambda s: full_step(s, batch), "lora": lambda s: lora_step(s, base, batch)}
    times: dict[str, list[float]] = {"full": [], "lora": []}
    for name in states:  # compile and run once, untimed
        states[name], _ = steps[name](states[name])
        jax.block_until_ready(states[name])
    for _ in range(args.rounds):
        for name in states:
            for _ in range(args.steps):
                start = time.perf_counter()
                states[name], metrics = steps[name](states[name])
                jax.block_until_ready(states[name])
                times[name].append(time.perf_counter() - start)

    def count(tree) -> int:
        return sum(int(np.size(a)) for a in jax.tree_util.tree_leaves(tree))

    full_s, lora_s = (statistics.median(times[n]) for n in ("full", "lora"))
    print(
        f"llama d{args.d_model} L{args.layers} GQA {args.heads}/{args.kv_heads} ff {4 * args.d_model} "
        f"vocab {args.vocab}, batch {args.batch} x seq {args.seq}, compute {args.dtype}, "
        f"{jax.device_count()} {jax.default_backend()} device(s)"
    )
    print(
        f"LoRA rank {args.rank} on {','.join(settings.targets)}, base held in {args.base_dtype}: "
        f"{count(states['lora']['params']):,} trained parameters of "
        f"{count(full_state_shape(cfg)):,}"
    )
    print(f"full fine-tuning: {full_s * 1e3:.1f} ms/update   LoRA: {lora_s * 1e3:.1f} ms/update")
    print(
        f"LoRA / full: {lora_s / full_s:.3f}   (compiled FLOPs LoRA / full: "
        f"{flops['lora'] / flops['full']:.3f})"
    )


def _flops(compiled) -> float:
    """XLA's FLOP count of the compiled update (the frozen base's weight gradients are absent
    from the LoRA program: this ratio says how much matrix work LoRA removes)."""
    analysis = compiled.cost_analysis()
    analysis = analysis[0] if isinstance(analysis, list) else analysis
    return float(analysis.get("flops", float("nan")))


def full_state_shape(cfg):
    return jax.eval_shape(lambda: llama.init_params(cfg, jax.random.key(0)))


if __name__ == "__main__":
    main()
