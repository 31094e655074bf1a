"""grpo update: ``make_update`` against a minimal GRPO loss + AdamW loop written here, at the
same shapes; with ``--split``, the split of one update's time between rollout, rewards,
reference and policy, timed as ``GRPOProgram.dispatch`` times them for the ``update`` event.

The model: Llama architecture (``--d-model``, ``--heads``, ``--kv-heads``, ``--ffn``,
``--layers``, ``--vocab``; the defaults are the ones ``grpo_rollouts.py`` measures), compute
``--dtype``. The batch: ``--rows`` completions (``--prompts`` x G) of ``--prompt-len`` prompt
tokens and up to ``--new`` completion tokens (random lengths from a quarter of it) in rows of
``seq_len = prompt-len + new`` slots; loss type dapo, ``num_iterations`` (mu) 1, beta 0,
epsilon 0.2, temperature 1; AdamW with the recipe schema's defaults (global-norm clipping 1,
weight decay on matrices).

- **minifield**: ``make_update(cfg, optimizer, schedule, settings, 1, 1.0)`` from
  ``minifield.strategies.grpo.update`` with ``optimizer.make_optimizer``, ``jax.jit`` with
  the state donated and compiled ahead for the batch's shapes, exactly as
  ``GRPOProgram.compile`` builds it; its metrics (loss, grad norm, entropy, clipped
  fractions) included, as the program computes them.
- **minimal**: the same model from the equations (``minimal.llama.logits``: RMSNorm,
  rotary, GQA by repeating key/value heads, causal softmax, SwiGLU, untied head; in BF16 each
  product BF16 x BF16 -> FP32 forward and backward, as ours), then the GRPO loss written
  here: log-softmax over the vocabulary, the completion tokens' log-probabilities gathered,
  ratio ``exp(logp - stop_gradient(logp))`` clipped to ``[1 - 0.2, 1 + 0.2]``, the token sum
  of ``-min(r A, clip(r) A)`` over the completion tokens divided by their count; ``grad``;
  ``optax.chain(clip_by_global_norm, adamw)``; ``jax.jit`` with donation. It returns the
  gradient's global norm beside the loss, as ours does (``grad_norm``).

Both are compiled first (untimed), then timed ``--repeats`` times, interleaved (who goes first
alternating); printed: min and median (wall and process CPU) and minifield / minimal (goal
<= 1.05), and, as a cross-check of the two computations, the first update's loss (at mu 1 the
ratio is 1, so it is ``-sum(A)/tokens`` whatever the model) and gradient norm of each.

``--split`` instead runs the parts of one update as the program runs them at these shapes
(no stop token, so every completion has ``--new`` tokens): ``rollouts.sample_groups`` (the
recipe's sampling defaults), the rewards (a stand-in scored in NumPy: the rewards' own cost
depends on the recipe) with ``advantages`` and ``rollouts_file.batch_of``, the reference
policy's log-probabilities (``make_reference``: what ``beta > 0`` adds; with beta 0 the
program skips it and reports 0), and the compiled update; each compiled by a first call, then
timed ``--repeats`` times; printed: the median seconds of each and its share.

    .venv/bin/python benchmarks/grpo_update.py [--vocab 32000 --repeats 3] [--split]
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
import optax

sys.path.insert(0, str(Path(__file__).resolve().parent))
import grpo_rollouts  # noqa: E402
from minimal import llama as minimal  # noqa: E402

from minifield.models.sampling import Sampling  # noqa: E402
from minifield.rl import advantages as group_advantages  # noqa: E402
from minifield.rl import objective, rollouts  # noqa: E402
from minifield.strategies.grpo import rollouts_file  # noqa: E402
from minifield.strategies.grpo import update as grpo_update  # noqa: E402
from minifield.training import optimizer as project_optimizer  # noqa: E402
from minifield.training.train_step import init_train_state  # noqa: E402

MAX_STEPS = 1000
TRAINING = {"learning_rate": 1e-5, "warmup_steps": 2}
EPSILON, TEMPERATURE = 0.2, 1.0
RL = {"loss_type": "dapo", "mask_truncated_completions": False, "scale_rewards": "group"}


def make_batch(args, rng) -> rollouts_file.Batch:
    """Random rows: a prompt, then a completion of random length, the dapo weights (the
    update's typed batch, which both loops read)."""
    N, S = args.prompts * args.G, args.prompt_len + args.new
    tokens = rng.integers(3, args.vocab, (N, S)).astype(np.int32)
    mask = np.zeros((N, S), np.float32)
    for row, n in enumerate(rng.integers(args.new // 4, args.new + 1, N)):
        mask[row, args.prompt_len : args.prompt_len + n] = 1.0
        tokens[row, args.prompt_len + n :] = 0
    rewards = rng.integers(0, 2, N).astype(np.float64)
    return rollouts_file.Batch(
        tokens=tokens,
        mask=mask,
        weights=group_advantages.token_weights("dapo", mask, args.new),
        advantages=group_advantages.advantages(rewards, args.G, "group").astype(np.float32),
    )


def make_minimal(cfg, compute):
    """``(step, optimizer)``: one GRPO update (mu 1, dapo, beta 0) of the minimal model."""
    shape = minimal.Shape(
        cfg.d_model, cfg.n_layers, cfg.n_heads, cfg.n_kv_heads, cfg.d_ff, cfg.vocab_size,
        cfg.rope_theta, cfg.norm_eps,
    )  # fmt: skip
    d = project_optimizer.defaults()
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, TRAINING["learning_rate"], TRAINING["warmup_steps"], MAX_STEPS
    )
    opt = optax.chain(
        optax.clip_by_global_norm(d["grad_clip_norm"]),
        optax.adamw(
            schedule, b1=d["b1"], b2=d["b2"], eps=d["eps"], weight_decay=d["weight_decay"],
            mask=lambda params: jax.tree_util.tree_map(lambda x: x.ndim >= 2, params),
        ),
    )  # fmt: skip

    def grpo_loss(params, batch):
        tokens = batch.tokens
        N, S = tokens.shape
        positions = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (N, S))
        rows = minimal.Rows(tokens, jnp.ones((N, S), jnp.int32), positions, loss_mask=None)
        logits = minimal.logits(params, rows, shape, compute)[:, :-1] / TEMPERATURE
        logp = jnp.take_along_axis(jax.nn.log_softmax(logits, -1), tokens[:, 1:, None], -1)
        logp = logp[..., 0]
        ratio = jnp.exp(logp - jax.lax.stop_gradient(logp))
        adv = batch.advantages[:, None]
        per_token = -jnp.minimum(ratio * adv, jnp.clip(ratio, 1 - EPSILON, 1 + EPSILON) * adv)
        mask = batch.mask[:, 1:]
        return jnp.sum(per_token * mask) / jnp.maximum(jnp.sum(mask), 1.0)

    def step(params, opt_state, batch):
        value, grads = jax.value_and_grad(grpo_loss)(params, batch)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value, optax.global_norm(grads)

    return step, opt


def make_ours(cfg):
    """``(update, optimizer)`` as ``GRPOProgram`` builds them (mu 1, dapo, beta 0)."""
    schedule = project_optimizer.make_schedule(TRAINING, MAX_STEPS)
    opt = project_optimizer.make_optimizer(TRAINING, MAX_STEPS, schedule)
    settings = objective.LossSettings(
        beta=0.0, epsilon=EPSILON, epsilon_high=EPSILON, importance_sampling_level="token"
    )
    return grpo_update.make_update(cfg, opt, schedule, settings, 1, TEMPERATURE), opt


def compare(args, cfg, batch) -> None:
    update, opt = make_ours(cfg)
    state = init_train_state(cfg, opt, 0)
    compute = jnp.bfloat16 if args.dtype == "bfloat16" else jnp.float32
    step, minimal_opt = make_minimal(cfg, compute)
    params = minimal.from_minifield(state["params"])
    held = {"minifield": state, "minimal": (params, minimal_opt.init(params))}
    started = time.perf_counter()
    ours = jax.jit(update, donate_argnums=(0,)).lower(state, batch).compile()
    compile_s = {"minifield": time.perf_counter() - started}
    started = time.perf_counter()
    theirs = jax.jit(step, donate_argnums=(0, 1)).lower(*held["minimal"], batch).compile()
    compile_s["minimal"] = time.perf_counter() - started

    def run_ours():
        held["minifield"], metrics, _ = ours(held["minifield"], batch)
        jax.block_until_ready(held["minifield"])
        return {k: float(v) for k, v in metrics.items()}

    def run_minimal():
        params, opt_state, value, grad_norm = theirs(*held["minimal"], batch)
        held["minimal"] = jax.block_until_ready((params, opt_state))
        return {"loss": float(value), "grad_norm": float(grad_norm)}

    calls = {"minifield": run_ours, "minimal": run_minimal}
    wall = {name: [] for name in calls}
    cpu = {name: [] for name in calls}
    load_before = os.getloadavg()[0]
    first = {}
    for r in range(args.repeats):
        for name in list(calls)[:: 1 if r % 2 == 0 else -1]:
            start, start_cpu = time.perf_counter(), time.process_time()
            out = calls[name]()
            wall[name].append(time.perf_counter() - start)
            cpu[name].append(time.process_time() - start_cpu)
            first.setdefault(name, out)
    load_after = os.getloadavg()[0]
    print(header(args, cfg, batch) + f"; load average {load_before:.1f} -> {load_after:.1f}")
    for name in calls:
        w, c = wall[name], cpu[name]
        print(
            f"{name:>10}: wall min {min(w):7.2f} s  median {statistics.median(w):7.2f} s   "
            f"CPU min {min(c):7.2f} s  median {statistics.median(c):7.2f} s   "
            f"(compile {compile_s[name]:.1f} s)"
        )
    for label, t in (("wall", wall), ("CPU", cpu)):
        by_min = min(t["minifield"]) / min(t["minimal"])
        by_median = statistics.median(t["minifield"]) / statistics.median(t["minimal"])
        print(
            f"minifield / minimal ({label}): min {by_min:.3f}  median {by_median:.3f} "
            "(goal <= 1.05)"
        )
    ours_first, theirs_first = first["minifield"], first["minimal"]
    print(
        f"first update (same parameters): loss minifield {ours_first['loss']:.6g}, minimal "
        f"{theirs_first['loss']:.6g}; gradient norm minifield {ours_first['grad_norm']:.6g}, "
        f"minimal {theirs_first['grad_norm']:.6g} (relative difference "
        f"{abs(ours_first['grad_norm'] / theirs_first['grad_norm'] - 1):.1e})"
    )


def split(args, cfg) -> None:
    """One update's parts timed as ``GRPOProgram.dispatch`` times them."""
    update, opt = make_ours(cfg)
    state = init_train_state(cfg, opt, 0)
    compiled = jax.jit(update, donate_argnums=(0,))
    reference = grpo_update.make_reference(cfg, TEMPERATURE)
    ref_params = jax.tree_util.tree_map(jnp.array, state["params"])
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, args.vocab, args.prompt_len).tolist() for _ in range(args.prompts)]
    seq_len = args.prompt_len + args.new
    rl = {**RL, "max_completion_length": args.new}
    parts = ("rollout", "reward", "reference", "policy")
    times = {part: [] for part in parts}
    for r in range(args.repeats + 1):  # the first one compiles
        t = {}
        started = time.monotonic()
        made = rollouts.sample_groups(
            state["params"], cfg, prompts, np.arange(args.prompts), args.G,
            max_new=args.new, stops=(), sampling=Sampling(1.0, 0, 1.0), seed=0, update=r + 1,
            length=seq_len,
        )  # fmt: skip
        t["rollout"] = time.monotonic() - started
        started = time.monotonic()
        # a stand-in reward: the share of even token ids (the real ones cost what they cost)
        total = np.asarray([np.mean(np.asarray(c) % 2 == 0) for c in made.completion_ids])
        adv = group_advantages.advantages(total, args.G, rl["scale_rewards"])
        batch = rollouts_file.batch_of(made, adv, rl, seq_len)
        t["reward"] = time.monotonic() - started
        started = time.monotonic()
        np.asarray(reference(ref_params, jnp.asarray(batch.tokens)))
        t["reference"] = time.monotonic() - started
        started = time.monotonic()
        state, metrics, _ = compiled(state, jax.tree_util.tree_map(jnp.asarray, batch))
        jax.block_until_ready(state)
        t["policy"] = time.monotonic() - started
        if r:
            for part in parts:
                times[part].append(t[part])
    median = {part: statistics.median(times[part]) for part in parts}
    print(header(args, cfg, None) + f"; load average {os.getloadavg()[0]:.1f}")
    whole = sum(median.values())
    for part in parts:
        note = " (beta > 0 only: 0 at beta 0)" if part == "reference" else ""
        print(
            f"{part + '_seconds':>18}: median {median[part]:7.3f} s  "
            f"{100 * median[part] / whole:5.1f} %{note}"
        )
    beta0 = whole - median["reference"]
    print(
        f"beta 0 (no reference): rollout {100 * median['rollout'] / beta0:.1f} %, reward "
        f"{100 * median['reward'] / beta0:.1f} %, policy {100 * median['policy'] / beta0:.1f} %"
        f" of {beta0:.2f} s"
    )


def header(args, cfg, batch) -> str:
    rows = args.prompts * args.G
    tokens = "" if batch is None else f", {int(batch.mask.sum())} completion tokens"
    return (
        f"llama d{cfg.d_model} L{cfg.n_layers} GQA {cfg.n_heads}/{cfg.n_kv_heads} head_dim "
        f"{cfg.head_dim} ffn {cfg.d_ff} vocab {cfg.vocab_size}, compute {args.dtype}; {rows} "
        f"rows ({args.prompts} prompts x G {args.G}) x seq_len {args.prompt_len + args.new} "
        f"(prompt {args.prompt_len} + up to {args.new}){tokens}; mu 1, dapo, beta 0; "
        f"{jax.device_count()} {jax.default_backend()} device(s)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    grpo_rollouts.add_arguments(parser)
    parser.add_argument("--split", action="store_true", help="time an update's parts instead")
    args = parser.parse_args()
    cfg = grpo_rollouts.config(args)
    if args.split:
        split(args, cfg)
    else:
        compare(args, cfg, make_batch(args, np.random.default_rng(0)))


if __name__ == "__main__":
    main()
