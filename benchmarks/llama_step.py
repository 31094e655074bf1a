"""Llama train-step benchmark: the project's packed-SFT step against a minimal JAX+optax loop.

The model: Llama architecture, d512, 8 layers, GQA 8 query / 2 key-value heads, SwiGLU d_ff
1408, vocabulary 8192, untied head, sequence 512, a batch of packed rows (several segments
per row, loss on half of each). Measured in one run, interleaved round by round so the
ratio comes from the same window on this shared machine:

- **ours**: ``LlamaConfig`` + ``optimizer.make_optimizer`` + ``sft_step.make_train_step``,
  jit-compiled once with the state donated, exactly as the worker runs it;
- **minimal**: the same model written here from the equations (RMSNorm, rotary, GQA by
  repeating key/value heads, segment-restricted causal softmax, SwiGLU, cross-entropy on the
  counted targets) as one params dict, one loss, ``optax.chain(clip_by_global_norm,
  adamw(warmup+cosine))``, ``jax.jit`` with donation; in BF16 mode each product is BF16 x
  BF16 with FP32 accumulation in forward and backward (its own custom VJP), as ours.

Printed: median step time of each, ours / minimal (goal ≤ 1.05), per compute dtype.

    uv run --locked python benchmarks/llama_step.py [--batch 2] [--rounds 5] [--steps 3]
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

from minifield.strategies.packed_sft.llama import LlamaConfig
from minifield.strategies.packed_sft.optimizer import DEFAULTS, make_optimizer
from minifield.strategies.packed_sft.sft_step import init_train_state, make_train_step

D, LAYERS, HEADS, KV_HEADS, D_FF, VOCAB, SEQ = 512, 8, 8, 2, 1408, 8192, 512
THETA, EPS = 10000.0, 1e-6
MAX_STEPS = 1000
F32, BF16 = jnp.float32, jnp.bfloat16


def packed_batch(B: int, T: int, seed: int = 0) -> dict:
    """Rows of several segments (16..T/2 tokens), positions restarting per segment, loss on
    the second half of each segment, a little padding at the end of a row."""
    rng = np.random.default_rng(seed)
    batch = {k: np.zeros((B, T), np.int32) for k in ("tokens", "segments", "positions")}
    batch["loss_mask"] = np.zeros((B, T), np.float32)
    batch["tokens"][:] = rng.integers(0, VOCAB, (B, T))
    for r in range(B):
        at, seg = 0, 1
        while at < T - 20:
            n = int(min(rng.integers(16, T // 2), T - 4 - at))
            batch["segments"][r, at : at + n] = seg
            batch["positions"][r, at : at + n] = np.arange(n)
            batch["loss_mask"][r, at + n // 2 : at + n] = 1.0
            at, seg = at + n, seg + 1
    return {k: jnp.asarray(v) for k, v in batch.items()}


# ----------------------------------------------------------------------------- minimal loop


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def bf16_dot(eq, a, b):
    """BF16 x BF16 -> FP32 einsum whose backward products are BF16 x BF16 -> FP32 too."""
    return jnp.einsum(eq, a.astype(BF16), b.astype(BF16), preferred_element_type=F32)


def _bf16_dot_fwd(eq, a, b):
    # the operands' dtypes ride along as zero-size arrays (residuals must be arrays)
    protos = (jnp.zeros((0,), a.dtype), jnp.zeros((0,), b.dtype))
    return bf16_dot(eq, a, b), (a.astype(BF16), b.astype(BF16), *protos)


def _bf16_dot_bwd(eq, res, g):
    a, b, a_proto, b_proto = res
    ins, out = eq.split("->")
    sa, sb = ins.split(",")
    g = g.astype(BF16)
    da = jnp.einsum(f"{out},{sb}->{sa}", g, b, preferred_element_type=F32)
    db = jnp.einsum(f"{sa},{out}->{sb}", a, g, preferred_element_type=F32)
    return da.astype(a_proto.dtype), db.astype(b_proto.dtype)


bf16_dot.defvjp(_bf16_dot_fwd, _bf16_dot_bwd)


def minimal_init(key) -> dict:
    K = D // HEADS
    keys = iter(jax.random.split(key, 4 + 7 * LAYERS))

    def normal(shape, scale):
        return jax.random.normal(next(keys), shape, F32) * scale

    layers = [
        {
            "ln1": jnp.ones(D),
            "ln2": jnp.ones(D),
            "wq": normal((D, HEADS * K), D**-0.5),
            "wk": normal((D, KV_HEADS * K), D**-0.5),
            "wv": normal((D, KV_HEADS * K), D**-0.5),
            "wo": normal((HEADS * K, D), D**-0.5),
            "wg": normal((D, D_FF), D**-0.5),
            "wu": normal((D, D_FF), D**-0.5),
            "wd": normal((D_FF, D), D_FF**-0.5),
        }
        for _ in range(LAYERS)
    ]
    return {
        "emb": normal((VOCAB, D), 0.02),
        "layers": layers,
        "norm": jnp.ones(D),
        "head": normal((D, VOCAB), D**-0.5),
    }


def minimal_loss(params, batch, compute):
    dot = (lambda eq, a, b: bf16_dot(eq, a, b)) if compute == BF16 else jnp.einsum
    tokens, seg, pos = batch["tokens"], batch["segments"], batch["positions"]
    B, T = tokens.shape
    K = D // HEADS

    def rms(x, scale):
        x = x.astype(F32)
        return (x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + EPS) * scale).astype(compute)

    inv = THETA ** (-jnp.arange(0, K, 2, dtype=F32) / K)
    angle = pos[..., None].astype(F32) * inv  # [B, T, K/2]
    cos, sin = jnp.cos(angle)[:, :, None], jnp.sin(angle)[:, :, None]

    def rope(x):
        x1, x2 = x[..., : K // 2].astype(F32), x[..., K // 2 :].astype(F32)
        return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).astype(compute)

    causal = jnp.tril(jnp.ones((T, T), bool))
    mask = (seg[:, :, None] == seg[:, None, :]) & (seg[:, :, None] != 0) & causal  # [B, T, T]
    h = params["emb"][tokens].astype(compute)
    for p in params["layers"]:
        x = rms(h, p["ln1"])
        q = rope(dot("btd,dn->btn", x, p["wq"]).astype(compute).reshape(B, T, HEADS, K))
        k = rope(dot("btd,dn->btn", x, p["wk"]).astype(compute).reshape(B, T, KV_HEADS, K))
        v = dot("btd,dn->btn", x, p["wv"]).astype(compute).reshape(B, T, KV_HEADS, K)
        k = jnp.repeat(k, HEADS // KV_HEADS, axis=2)
        v = jnp.repeat(v, HEADS // KV_HEADS, axis=2)
        q, k, v = (t.transpose(0, 2, 1, 3).reshape(B * HEADS, T, K) for t in (q, k, v))
        s = dot("ntk,nsk->nts", q, k).reshape(B, HEADS, T, T) * K**-0.5
        s = jnp.where(mask[:, None], s, jnp.finfo(F32).min)
        a = jax.nn.softmax(s, -1).astype(compute).reshape(B * HEADS, T, T)
        o = dot("nts,nsk->ntk", a, v).astype(compute)
        o = o.reshape(B, HEADS, T, K).transpose(0, 2, 1, 3).reshape(B, T, D)
        h = h + dot("btn,nd->btd", o, p["wo"]).astype(compute)
        x = rms(h, p["ln2"])
        g = dot("btd,df->btf", x, p["wg"])
        u = dot("btd,df->btf", x, p["wu"])
        h = h + dot("btf,fd->btd", (jax.nn.silu(g) * u).astype(compute), p["wd"]).astype(compute)
    logits = dot("btd,dv->btv", rms(h, params["norm"]), params["head"])
    targets = jnp.pad(tokens[:, 1:], ((0, 0), (0, 1)))
    counted = (seg[:, :-1] == seg[:, 1:]) & (seg[:, :-1] != 0)
    weight = jnp.pad(jnp.where(counted, batch["loss_mask"][:, 1:], 0.0), ((0, 0), (0, 1)))
    logp = jax.nn.log_softmax(logits, -1)
    nll = -jnp.take_along_axis(logp, targets[..., None], -1)[..., 0]
    return jnp.sum(nll * weight) / jnp.maximum(jnp.sum(weight), 1.0)


def minimal_step(compute):
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, DEFAULTS["learning_rate"], DEFAULTS["warmup_steps"], MAX_STEPS
    )
    optimizer = optax.chain(
        optax.clip_by_global_norm(DEFAULTS["grad_clip_norm"]),
        optax.adamw(
            schedule,
            b1=DEFAULTS["b1"],
            b2=DEFAULTS["b2"],
            eps=DEFAULTS["eps"],
            weight_decay=DEFAULTS["weight_decay"],
            mask=lambda params: jax.tree_util.tree_map(lambda x: x.ndim >= 2, params),
        ),
    )

    def step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(minimal_loss)(params, batch, compute)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    params = minimal_init(jax.random.key(0))
    return jax.jit(step, donate_argnums=(0, 1)), params, optimizer.init(params)


# ----------------------------------------------------------------------------- timing


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=3, help="timed steps per round")
    parser.add_argument("--dtypes", default="bfloat16,float32")
    args = parser.parse_args()
    batch = packed_batch(args.batch, SEQ)
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
        mini, params, opt_state = minimal_step(BF16 if dtype == "bfloat16" else F32)
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
