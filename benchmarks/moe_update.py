"""Mixture-of-experts update: minifield's train step on a Mixtral-shaped model against minimal
JAX loops written here, and against running every expert on every token.

The model: Llama attention (d512, ``--layers`` 2, GQA 8/2 heads, rotary, untied head, vocabulary
512) with Mixtral's MLP in every layer: ``--experts`` experts of width ``--ffn`` 1024, the top
2 per token (softmax, top-k, renormalised), one packed batch of ``--rows`` x ``--seq``
(2 x 256: 512 tokens, 1,024 (token, expert) pairs), compute ``--dtype``. Each loop is one
training update (forward, backward, global-norm clipping, AdamW with the recipe schema's
defaults), ``jax.jit`` with the state donated, compiled ahead, then run once untimed:

- **minifield**: ``LlamaConfig(n_experts=…)`` + ``optimizer.make_optimizer`` +
  ``train_step.make_train_step``, as the worker runs it: experts held one matrix per expert,
  stacked inside the step, the grouped product of :mod:`minifield.models.layers.grouped`;
- **minimal ragged_dot**: the same model from the equations (``_llama_minimal.logits`` with a
  mixture-of-experts MLP written here: FP32 router, softmax, top-k renormalised, the (token,
  expert) pairs sorted by expert, the tokens gathered, one ``jax.lax.ragged_dot`` per
  projection against the experts held stacked ``[E, in, out]``, weighted, scatter-added back),
  ``_llama_minimal.make_optimizer``, plain autodiff;
- **minimal grouped**: that loop with minifield's grouped product in place of ``ragged_dot``
  (experts still held stacked): what minifield costs beyond the product itself;
- **dense**: that loop with every expert on every token, each output times the token's router
  weight for it (0 for experts outside its top 2), ``[E, N, F]`` intermediates.

Line 1 (``--experts``, 8): minifield, minimal ragged_dot, minimal grouped; line 2
(``--dense-experts``, 16): minifield and dense. Printed per loop: median seconds per update
(wall, and CPU time of the process), the ratios of the medians against minifield, the first
update's loss and gradient norm of each (they must agree: the same parameters, the same
batch), the load average before and after; and at the end each loop's loss at the first
parameters computed in FP32 (agreement within FP32 rounding: the loops compute the same
function). Rounds interleave the loops, the first one alternating.

    .venv/bin/python benchmarks/moe_update.py [--experts 8 --dense-experts 16 --rounds 3]
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
import optax

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _llama_minimal as minimal  # noqa: E402

from minifield.models import model as project_model  # noqa: E402
from minifield.models.execution import Execution  # noqa: E402
from minifield.models.layers import grouped, tpu_grouped  # noqa: E402
from minifield.models.llama import LlamaConfig  # noqa: E402
from minifield.training.optimizer import make_optimizer  # noqa: E402
from minifield.training.train_step import init_train_state, make_train_step  # noqa: E402

F32 = jnp.float32
HEADS, KV_HEADS, TOP_K, VOCAB, MAX_STEPS = 8, 2, 2, 512, 1000


def config(args, experts: int, dtype: str) -> LlamaConfig:
    """The model; ``args.backend`` (absent: any) is the recipe's ``runtime.backend``, which
    picks minifield's grouped product (``execution.grouped_kernel``)."""
    return LlamaConfig(
        vocab_size=VOCAB, d_model=args.d_model, n_layers=args.layers, n_heads=HEADS,
        n_kv_heads=KV_HEADS, d_ff=args.ffn, max_len=args.seq, compute_dtype=dtype,
        n_experts=experts, experts_per_token=TOP_K,
        execution=Execution(backend=getattr(args, "backend", "any")),
    )  # fmt: skip


def stacked_mlp(block: dict) -> dict:
    """A minifield block's router and experts in ``_llama_minimal``'s names, experts stacked."""
    experts = block["moe"]["experts"]
    order = sorted(experts, key=int)
    return {
        "router": jnp.array(block["moe"]["router"]),
        **{k: jnp.stack([experts[j][n] for j in order]) for k, n in minimal.MLP_NAMES.items()},
    }


def _routing(p, x_NxD):
    """Mixtral's routing: FP32 softmax over every expert, the top k renormalised."""
    logits = jnp.dot(x_NxD.astype(F32), p["router"], precision=jax.lax.Precision.HIGHEST)
    weights_NxK, experts_NxK = jax.lax.top_k(jax.nn.softmax(logits, -1), TOP_K)
    return weights_NxK / jnp.sum(weights_NxK, -1, keepdims=True), experts_NxK


def sorted_mlp(product):
    """The grouped mixture: ``product(rows [M, in] compute, w [E, in, out], sizes [E])`` ->
    ``[M, out]`` FP32 is ``ragged_dot`` or minifield's grouped product."""

    def mlp(p, x_BxTxD, dot, compute):
        B, T, D = x_BxTxD.shape
        x_NxD = x_BxTxD.reshape(B * T, D)
        weights_NxK, experts_NxK = _routing(p, x_NxD)
        flat = experts_NxK.reshape(-1)
        order = jnp.argsort(flat, stable=True)
        token = order // TOP_K
        sizes = jnp.bincount(flat, length=p["router"].shape[1]).astype(jnp.int32)
        xs = x_NxD[token].astype(compute)
        act = jax.nn.silu(product(xs, p["wg"], sizes)) * product(xs, p["wu"], sizes)
        out = product(act.astype(compute), p["wd"], sizes).astype(compute).astype(F32)
        weighted = out * weights_NxK.reshape(-1)[order][:, None]
        return jnp.zeros((B * T, D), F32).at[token].add(weighted).astype(compute).reshape(B, T, D)

    return mlp


def ragged_product(compute):
    def product(xs, w, sizes):
        precision = jax.lax.Precision.HIGHEST if jnp.dtype(compute) == F32 else None
        w = w.astype(compute)
        return jax.lax.ragged_dot(xs, w, sizes, precision, preferred_element_type=F32)

    return product


def grouped_product(cfg):
    return lambda xs, w, sizes: grouped.matmul(cfg, xs, w, sizes)


def gmm_product(cfg):
    """megablox's ``gmm`` as minifield calls it on a TPU (BF16 only; Pallas's interpreter on
    CPU, slow)."""
    return lambda xs, w, sizes: tpu_grouped.matmul(cfg.compute_dtype, xs, w, sizes, "gmm")


def dense_mlp(p, x_BxTxD, dot, compute):
    """Every expert on every token; the outputs weighted by the router (0 outside the top k)."""
    B, T, D = x_BxTxD.shape
    x_NxD = x_BxTxD.reshape(B * T, D)
    weights_NxK, experts_NxK = _routing(p, x_NxD)
    E = p["router"].shape[1]
    gate_NxE = jnp.sum(jax.nn.one_hot(experts_NxK, E, dtype=F32) * weights_NxK[..., None], 1)
    g = dot("nd,edf->enf", x_NxD, p["wg"])
    u = dot("nd,edf->enf", x_NxD, p["wu"])
    out = dot("enf,efd->end", (jax.nn.silu(g) * u).astype(compute), p["wd"])
    y = jnp.sum(out.astype(compute).astype(F32) * gate_NxE.T[:, :, None], 0)
    return y.astype(compute).reshape(B, T, D)


def minimal_step(cfg, mlp):
    """``(step, optimizer)``: the minimal update with ``mlp``, returning the loss and the
    gradient's global norm as minifield's metrics do."""
    shape = minimal.Shape(
        cfg.d_model, cfg.n_layers, cfg.n_heads, cfg.n_kv_heads, cfg.d_ff, cfg.vocab_size,
        cfg.rope_theta, cfg.norm_eps,
    )  # fmt: skip
    opt = minimal.make_optimizer(MAX_STEPS)

    def step(params, opt_state, batch):
        value, grads = jax.value_and_grad(minimal.loss)(params, batch, shape, cfg.dtype, "xla", mlp)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value, optax.global_norm(grads)

    def fp32_loss(params, batch):
        return minimal.loss(params, batch, shape, F32, "xla", mlp)

    return step, opt, fp32_loss


def loops(args, experts: int, names: tuple, batch: dict) -> dict:
    """``{name: {"run": run(), "first": (loss, grad_norm), "fp32": loss}}``, each compiled and
    run once (its first update's loss and gradient norm kept)."""
    cfg = config(args, experts, args.dtype)
    cfg32 = config(args, experts, "float32")
    opt = make_optimizer({}, MAX_STEPS)
    state = init_train_state(cfg, opt, 0)
    first_params = minimal.from_minifield(state["params"], stacked_mlp)
    out = {}
    if "minifield" in names:
        fp32 = jax.jit(project_model.loss_fn, static_argnums=1)(state["params"], cfg32, batch)
        step = jax.jit(make_train_step(cfg, opt), donate_argnums=(0,)).lower(state, batch)
        out["minifield"] = {"compiled": step.compile(), "held": state, "fp32": float(fp32[0])}
    mlps = {
        "minimal ragged_dot": sorted_mlp(ragged_product(cfg.dtype)),
        "minimal grouped": sorted_mlp(grouped_product(cfg)),
        "minimal gmm": sorted_mlp(gmm_product(cfg)),
        "dense": dense_mlp,
    }
    mlps32 = {
        "minimal ragged_dot": sorted_mlp(ragged_product(F32)),
        "minimal grouped": sorted_mlp(grouped_product(cfg32)),
        "dense": dense_mlp,
    }
    for name in names:
        if name == "minifield":
            continue
        step, mopt, _ = minimal_step(cfg, mlps[name])
        params = jax.tree_util.tree_map(jnp.array, first_params)
        fp32 = float("nan")  # gmm has no FP32 form (tpu_grouped)
        if name in mlps32:
            fp32 = float(jax.jit(minimal_step(cfg32, mlps32[name])[2])(params, batch))
        held = (params, mopt.init(params))
        compiled = jax.jit(step, donate_argnums=(0, 1)).lower(*held, batch).compile()
        out[name] = {"compiled": compiled, "held": held, "fp32": fp32}
    for name, loop in out.items():
        loop["run"] = _runner(loop, name == "minifield", batch)
        loop["first"] = loop["run"]()
    return out


def _runner(loop: dict, ours: bool, batch: dict):
    def run() -> tuple[float, float]:
        if ours:
            loop["held"], metrics = loop["compiled"](loop["held"], batch)
            return float(metrics["loss"]), float(metrics["grad_norm"])
        params, opt_state, value, norm = loop["compiled"](*loop["held"], batch)
        loop["held"] = (params, opt_state)
        return float(value), float(norm)

    return run


def measure(args, experts: int, names: tuple, batch: dict) -> dict:
    """Prints each loop's line; returns ``{name: median wall seconds per update}``."""
    load = os.getloadavg()[0]
    runs = loops(args, experts, names, batch)
    times = {(n, c): [] for n in names for c in ("wall", "cpu")}
    for r in range(args.rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            wall, cpu = time.perf_counter(), time.process_time()
            runs[name]["run"]()
            times[name, "wall"].append(time.perf_counter() - wall)
            times[name, "cpu"].append(time.process_time() - cpu)
    med = {key: statistics.median(v) for key, v in times.items()}
    print(f"{experts} experts, top {TOP_K} (load {load:.2f} -> {os.getloadavg()[0]:.2f}):")
    for name in names:
        loss, norm = runs[name]["first"]
        ratio = (
            ""
            if name == "minifield"
            else f"; minifield / {name} = {med['minifield', 'wall'] / med[name, 'wall']:.3f} "
            f"wall, {med['minifield', 'cpu'] / med[name, 'cpu']:.3f} CPU"
        )
        print(
            f"  {name:>18}: {med[name, 'wall']:.3f} s wall, {med[name, 'cpu']:.3f} s CPU per "
            f"update (rounds {[round(t, 3) for t in times[name, 'wall']]}){ratio}; first "
            f"update loss {loss:.6f}, grad norm {norm:.6f}; FP32 loss "
            f"{runs[name]['fp32']:.7f}",
            flush=True,
        )
    return {name: med[name, "wall"] for name in names}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--d-model", type=int, default=512)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--ffn", type=int, default=1024)
    parser.add_argument("--rows", type=int, default=2)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--dense-experts", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    args = parser.parse_args()
    print(
        f"d{args.d_model}, {args.layers} layers, GQA {HEADS}/{KV_HEADS}, experts of width "
        f"{args.ffn}, vocab {VOCAB}, {args.rows} x {args.seq} tokens, {args.dtype}; "
        f"{jax.device_count()} {jax.devices()[0].platform} device(s), {os.cpu_count()} cpus; "
        f"median of {args.rounds} interleaved rounds"
    )
    batch = minimal.packed_batch(args.rows, args.seq, VOCAB)
    measure(args, args.experts, ("minifield", "minimal ragged_dot", "minimal grouped"), batch)
    measure(args, args.dense_experts, ("minifield", "dense"), batch)


if __name__ == "__main__":
    main()
