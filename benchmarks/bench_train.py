"""Train-step benchmark: the project's packed-SFT step against a minimal JAX+optax loop.

In one run on one machine it measures

(a) the matrix-multiply peak (FP32, and BF16 inputs with FP32 accumulation), probed in
    every round so MFU is computed against a peak from the same time window;
(b) our step (``model`` + ``optimizer.make_optimizer`` + ``sft_step.make_train_step``,
    jit-compiled once with donated state) for each model size and precision;
(c) a minimal, idiomatic JAX+optax loop of the same model written in this file
    (same architecture, segment mask, loss, AdamW + clipping; its own BF16 custom-VJP
    product so that its BF16 mode is the same computation as ours);
(d) with ``--worker-loop``, our update as the worker runs it (impl ``loop``): a real
    packed-sft program built from a recipe over generated SFT data (the worker's execution
    defaults), driven by the worker's ``UpdateLoop`` (``Program.dispatch`` with its batch
    prefetcher and host->device copy, metrics read back and an ``update`` event written to
    an events file); one update per call, state hashes at checkpoints only (the cadence
    that costs nothing per update; hashing cost is measured elsewhere). Its vocabulary is
    the program's tokenizer's; with ``--worker-loop`` every implementation uses that size.

Combinations are interleaved round by round so ratios come from the same window.
Printed per row: median step time, tokens/s, model GFLOP/s, MFU against the FP32 and
the BF16 peak, ours / minimal, and BF16 speed-up over FP32.

Usage: uv run python benchmarks/bench_train.py [--quick] [--rounds 5] [--steps 4]
    [--sizes d128 d256] [--worker-loop] [--json FILE]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_matmul import peak_probe  # noqa: E402

from minifield.data.packing import Rows  # noqa: E402
from minifield.models.model import ModelConfig, flops_per_token  # noqa: E402
from minifield.training.optimizer import make_optimizer  # noqa: E402
from minifield.training.train_step import init_train_state, make_train_step  # noqa: E402

SIZES = {"d128": (128, 2, 128), "d256": (256, 4, 256)}  # d_model, layers, seq
HEADS, VOCAB, BATCH = 4, 256, 16
TRAINING = {"learning_rate": 1e-3, "warmup_steps": 10, "weight_decay": 0.01}
MAX_STEPS = 1000


def packed_batch(B: int, T: int, seed: int = 0) -> Rows:
    """Random rows of several segments (10..T/2 tokens each), positions restarting,
    loss on the second half of each segment, and a little padding at the end."""
    rng = np.random.default_rng(seed)
    batch = Rows(*(np.zeros((B, T), np.int32) for _ in "tsp"), np.zeros((B, T), np.float32))
    batch.tokens[:] = rng.integers(0, VOCAB, (B, T))
    for r in range(B):
        at, seg = 0, 1
        while at < T - 12:
            n = int(min(rng.integers(10, T // 2), T - 4 - at))
            batch.segments[r, at : at + n] = seg
            batch.positions[r, at : at + n] = np.arange(n)
            batch.loss_mask[r, at + n // 2 : at + n] = 1.0
            at, seg = at + n, seg + 1
    return jax.tree_util.tree_map(jnp.asarray, batch)


# ----------------------------------------------------------------------------- minimal loop
# The same model in the plainest form: one params dict, one loss, optax.chain, jax.jit.


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def bf16_dot(eq, a, b):
    """BF16 x BF16 -> FP32 einsum whose backward products are BF16 x BF16 -> FP32 too."""
    return jnp.einsum(eq, a, b, preferred_element_type=jnp.float32)


def _bf16_dot_fwd(eq, a, b):
    return bf16_dot(eq, a, b), (a, b)


def _bf16_dot_bwd(eq, res, g):
    a, b = res
    ins, out = eq.split("->")
    ea, eb = ins.split(",")
    g = g.astype(jnp.bfloat16)
    da = jnp.einsum(f"{out},{eb}->{ea}", g, b, preferred_element_type=jnp.float32)
    db = jnp.einsum(f"{ea},{out}->{eb}", a, g, preferred_element_type=jnp.float32)
    return da.astype(a.dtype), db.astype(b.dtype)


bf16_dot.defvjp(_bf16_dot_fwd, _bf16_dot_bwd)


def minimal_init(key, D, L, T):
    ks = iter(jax.random.split(key, 2 + 4 * L))
    n = lambda shape, std: jax.random.normal(next(ks), shape) * std  # noqa: E731
    ln = lambda: (jnp.ones(D), jnp.zeros(D))  # noqa: E731
    return {
        "emb": n((VOCAB, D), 0.02),
        "pos": n((T, D), 0.02),
        "ln_f": ln(),
        "layers": [
            {
                "ln1": ln(),
                "ln2": ln(),
                "wqkv": n((D, 3 * D), D**-0.5),
                "bqkv": jnp.zeros(3 * D),
                "wo": n((D, D), D**-0.5),
                "bo": jnp.zeros(D),
                "w1": n((D, 4 * D), D**-0.5),
                "b1": jnp.zeros(4 * D),
                "w2": n((4 * D, D), (4 * D) ** -0.5),
                "b2": jnp.zeros(D),
            }
            for _ in range(L)
        ],
    }


def minimal_loss(params, batch, bf16):
    cdt = jnp.bfloat16 if bf16 else jnp.float32

    def mm(eq, a, b):
        return bf16_dot(eq, a, b) if bf16 else jnp.einsum(eq, a, b)

    def dense(x, w, b):
        return (mm("btk,kn->btn", x, w) + b).astype(cdt)

    def ln(x, p):
        x = x.astype(jnp.float32)
        sq, mu = jnp.mean(x * x, -1, keepdims=True), jnp.mean(x, -1, keepdims=True)
        y = (x - mu) * jax.lax.rsqrt(sq - mu * mu + 1e-5) * p[0] + p[1]
        return y.astype(cdt)

    tok, seg, pos = batch.tokens, batch.segments, batch.positions
    B, T = tok.shape
    if bf16:  # FP32 master weights, BF16 copies for the products
        emb16 = params["emb"].astype(cdt)
        params = {
            **params,
            "layers": jax.tree_util.tree_map(lambda w: w.astype(cdt), params["layers"]),
        }
    H, K = HEADS, params["emb"].shape[1] // HEADS
    mask = ((seg[:, :, None] == seg[:, None, :]) & jnp.tril(jnp.ones((T, T), bool)))[:, None]
    h = (params["emb"][tok] + params["pos"][pos]).astype(cdt)
    for p in params["layers"]:
        q, k, v = jnp.split(dense(ln(h, p["ln1"]), p["wqkv"], p["bqkv"]), 3, -1)
        q, k, v = (
            t.reshape(B, T, H, K).transpose(0, 2, 1, 3).reshape(B * H, T, K) for t in (q, k, v)
        )
        s = mm("ntk,nsk->nts", q, k).reshape(B, H, T, T) * K**-0.5
        a = jax.nn.softmax(jnp.where(mask, s, -1e30), -1).astype(cdt).reshape(B * H, T, T)
        o = mm("nts,nsk->ntk", a, v).astype(cdt).reshape(B, H, T, K).transpose(0, 2, 1, 3)
        h = h + dense(o.reshape(B, T, H * K), p["wo"], p["bo"])
        h = h + dense(jax.nn.gelu(dense(ln(h, p["ln2"]), p["w1"], p["b1"])), p["w2"], p["b2"])
    logits = mm("btd,vd->btv", ln(h, params["ln_f"]), emb16 if bf16 else params["emb"])
    logp = jax.nn.log_softmax(logits[:, :-1])
    nll = -jnp.take_along_axis(logp, tok[:, 1:, None], -1)[..., 0]
    w = batch.loss_mask[:, 1:] * ((seg[:, 1:] == seg[:, :-1]) & (seg[:, :-1] > 0))
    return jnp.sum(nll * w) / jnp.maximum(jnp.sum(w), 1.0)


def minimal_setup(D, L, T, bf16):
    schedule = optax.warmup_cosine_decay_schedule(0.0, 1e-3, 10, MAX_STEPS, 1e-4)
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule, weight_decay=0.01))
    params = minimal_init(jax.random.key(0), D, L, T)
    opt_state = tx.init(params)

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(minimal_loss)(params, batch, bf16)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    box = {"params": params, "opt": opt_state}

    def run(batch):
        box["params"], box["opt"], loss = step(box["params"], box["opt"], batch)
        return loss

    return run


# ----------------------------------------------------------------------------- ours


def ours_setup(D, L, T, bf16):
    cfg = ModelConfig(
        vocab_size=VOCAB,
        d_model=D,
        n_layers=L,
        n_heads=HEADS,
        d_ff=4 * D,
        max_len=T,
        compute_dtype="bfloat16" if bf16 else "float32",
    )
    tx = make_optimizer(TRAINING, MAX_STEPS)
    step = jax.jit(make_train_step(cfg, tx), donate_argnums=(0,))
    box = {"state": init_train_state(cfg, tx, seed=0)}

    def run(batch):
        box["state"], metrics = step(box["state"], batch)
        return metrics["loss"]

    return run, cfg


# ----------------------------------------------------------------------------- the worker's loop


def _worker_recipe(D, L, T, bf16, pins) -> dict:
    return {
        "job_id": "bench-loop",
        "product": {"name": "bench", "version": "0"},
        "strategy": {"name": "packed-sft", "version": "12.0.0"},
        "inputs": [
            {"name": s, "path": f"sft/{s}.jsonl", "sha256": pins[s]}
            for s in ("train", "dev", "test")
        ],
        "model": {
            "d_model": D,
            "n_layers": L,
            "n_heads": HEADS,
            "d_ff": 4 * D,
            "compute_dtype": "bfloat16" if bf16 else "float32",
        },
        "training": {"seq_len": T, "batch_size": BATCH, **TRAINING},
        "limits": {"max_steps": MAX_STEPS},
        "checkpoint": {"every_steps": MAX_STEPS, "keep": 1},
        "evaluation": {"eval_every": 0, "batch_size": BATCH, "max_generate_examples": 1},
    }


def worker_program(D, L, T, bf16, root: Path):
    """A packed-sft program as the worker builds it (recipe checked, examples prepared)."""
    import hashlib

    from minifield import recipe as recipes
    from minifield.data import encoding
    from minifield.strategies.packed_sft import demo_data

    data = root / "sft"
    pins = {}
    if not data.exists():
        data.mkdir(parents=True)
    sizes = {"train": 2000, "dev": 8, "test": 8}
    for split, rows in demo_data.demo_examples(seed=0, sizes=sizes).items():
        blob = encoding.to_jsonl(rows)
        (data / f"{split}.jsonl").write_bytes(blob)
        pins[split] = hashlib.sha256(blob).hexdigest()
    checked = recipes.validate(_worker_recipe(D, L, T, bf16, pins))
    files = {i["name"]: root / i["path"] for i in checked.data["inputs"]}
    arrays, _ = checked.strategy.prepare(checked.data, files)
    return checked.strategy.build(checked.data, arrays)


def worker_loop_setup(program, events_path: Path):
    """``run()``: one update through the worker's ``UpdateLoop`` (it returns once the update
    is reported, as the loop does at its last step)."""
    from minifield.attempt.events import EventLog
    from minifield.attempt.result import Progress
    from minifield.attempt.stopping import Stopping
    from minifield.attempt.update_loop import UpdateLoop
    from minifield.supervision import distributed

    events = EventLog(events_path, None)
    stopping = Stopping({}, stop_after_step=None, group=distributed.Group(), started_mono=0)
    box = {"state": program.place(program.init_state()), "step": 0}

    def run(_batch):
        loop = UpdateLoop(
            program,
            max_steps=box["step"] + 1,
            stopping=stopping,
            events=events,
            progress=Progress(),
            hooks=[],
            record_state_hashes="checkpoint",
            say=lambda message: None,
        )
        end = loop.run(box["state"], box["step"], 0.0)
        box["state"], box["step"] = end.state, end.step
        return end.state["step"]

    return run


# ----------------------------------------------------------------------------- driver


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(SIZES))
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--steps", type=int, default=6, help="steps of each combination per round")
    ap.add_argument("--quick", action="store_true", help="2 rounds of 4 steps, 1024^3 peak probe")
    ap.add_argument("--json", default=None, help="also write the rows to this file")
    ap.add_argument(
        "--worker-loop",
        action="store_true",
        help="also time our update as the worker's UpdateLoop runs it (impl 'loop')",
    )
    args = ap.parse_args()
    global VOCAB
    workdir = Path(tempfile.mkdtemp(prefix="bench-train-"))
    if args.quick:
        args.rounds, args.steps = 2, 4
    probe = peak_probe(1024 if args.quick else 2048)
    print(
        f"jax {jax.__version__} backend={jax.default_backend()} cpus={os.cpu_count()} "
        f"batch={BATCH} heads={HEADS} vocab={'program' if args.worker_loop else VOCAB} loadavg={os.getloadavg()[0]:.2f}",
        flush=True,
    )

    combos, peaks = {}, []
    for size in args.sizes:
        D, L, T = SIZES[size]
        for precision in ("f32", "bf16"):
            bf16 = precision == "bf16"
            impls = []
            if args.worker_loop:
                program = worker_program(D, L, T, bf16, workdir)
                VOCAB = program.cfg.vocab_size  # the same model in every implementation
                events = workdir / f"events-{size}-{precision}.jsonl"
                impls.append(("loop", worker_loop_setup(program, events)))
            batch = packed_batch(BATCH, T)
            ours, cfg = ours_setup(D, L, T, bf16)
            minimal = minimal_setup(D, L, T, bf16)
            for impl, run in (("ours", ours), ("minimal", minimal), *impls):
                t0 = time.perf_counter()
                run(batch).block_until_ready()
                first = time.perf_counter() - t0
                run(batch).block_until_ready()
                combos[(size, precision, impl)] = dict(run=run, batch=batch, cfg=cfg, first=first)
                print(
                    f"  compiled {size} {precision:4s} {impl:7s} first step {first:6.2f} s",
                    flush=True,
                )

    # Each round: probe the peak, then step every combination once per pass, `steps` passes.
    # Ratios are taken pass by pass (steps from the same few seconds, which the load of a
    # shared machine moves alike).
    # Wall time is what a user waits for; CPU time (all threads of this process) is the
    # work done, much less disturbed when other processes compete for the cores.
    times = {key: [] for key in combos}
    cpu = {key: [] for key in combos}
    # The order is shuffled every pass: a step that follows a large one (d256) starts with
    # cold caches, and a fixed order would always charge that to the same combination.
    order = random.Random(0)
    loads = []
    for r in range(args.rounds):
        peaks.append(probe())
        for _ in range(args.steps):
            keys = list(combos)
            order.shuffle(keys)
            for key in keys:
                c = combos[key]
                c0, t0 = time.process_time(), time.perf_counter()
                c["run"](c["batch"]).block_until_ready()
                times[key].append(time.perf_counter() - t0)
                cpu[key].append(time.process_time() - c0)
        loads.append(round(os.getloadavg()[0], 2))
        print(f"  round {r + 1}/{args.rounds} done, loadavg {loads[-1]:.2f}", flush=True)

    peak32 = statistics.median(p["f32"] for p in peaks)
    peak16 = statistics.median(p["bf16_f32acc"] for p in peaks)
    print(
        f"\nmatmul peak (median over rounds of best-of-3): f32 {peak32:.0f} GFLOP/s, "
        f"bf16 x bf16 -> f32 {peak16:.0f} GFLOP/s"
    )
    header = (
        f"{'size':5s} {'prec':4s} {'impl':7s} {'step_ms':>8s} {'min_ms':>7s} {'cpu_ms':>7s} "
        f"{'tok/s':>7s} {'GFLOP/s':>7s} {'MFU_f32':>7s} {'MFU_bf16':>8s} "
        f"{'ours/min':>8s} {'(cpu)':>6s} {'bf16_x':>6s} {'(cpu)':>6s}"
    )
    print(header)

    def pair_median(a, b):
        return statistics.median(x / y for x, y in zip(a, b, strict=True))

    rows = []
    for (size, precision, impl), ts in times.items():
        c = combos[(size, precision, impl)]
        D, L, T = SIZES[size]
        median = statistics.median(ts)
        cpu_median = statistics.median(cpu[(size, precision, impl)])
        tokens = BATCH * T
        gflops = flops_per_token(c["cfg"], T) * tokens / median / 1e9
        minimal = (size, precision, "minimal")
        ratio = pair_median(ts, times[minimal])
        ratio_cpu = pair_median(cpu[(size, precision, impl)], cpu[minimal])
        f32_key, bf16_key = (size, "f32", impl), (size, "bf16", impl)
        speedup = pair_median(times[f32_key], times[bf16_key])
        speedup_cpu = pair_median(cpu[f32_key], cpu[bf16_key])
        row = dict(
            size=size,
            d_model=D,
            n_layers=L,
            seq_len=T,
            batch=BATCH,
            vocab=c["cfg"].vocab_size,
            precision=precision,
            impl=impl,
            first_step_s=c["first"],
            step_ms=median * 1e3,
            step_ms_min=min(ts) * 1e3,
            cpu_ms=cpu_median * 1e3,
            step_ms_all=[t * 1e3 for t in ts],
            tokens_per_s=tokens / median,
            model_gflops=gflops,
            mfu_f32_peak=gflops / peak32,
            mfu_bf16_peak=gflops / peak16,
            ours_over_minimal=ratio,
            ours_over_minimal_cpu=ratio_cpu,
            bf16_speedup=speedup,
            bf16_speedup_cpu=speedup_cpu,
        )
        rows.append(row)
        print(
            f"{size:5s} {precision:4s} {impl:7s} {median * 1e3:8.1f} {min(ts) * 1e3:7.1f} "
            f"{cpu_median * 1e3:7.1f} {row['tokens_per_s']:7.0f} {gflops:7.1f} "
            f"{gflops / peak32:7.1%} {gflops / peak16:8.1%} {ratio:8.3f} {ratio_cpu:6.3f} "
            f"{speedup:6.2f} {speedup_cpu:6.2f}"
        )
    print(
        "step_ms: median wall time per step (min_ms: fastest); cpu_ms: median CPU time of all "
        "threads; MFU_f32/MFU_bf16: model FLOP/s (from step_ms) over the FP32 / BF16->FP32 "
        "matmul peak; ours/min: median over passes of our step / the minimal "
        "loop's, by wall and by CPU time; bf16_x: FP32 step / BF16 step (same implementation)."
    )
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {"peak_f32": peak32, "peak_bf16": peak16, "loadavg": loads, "rows": rows},
                indent=1,
            )
        )


if __name__ == "__main__":
    main()
