"""The minimal loop's mixtures of experts, the baselines ``moe_update.py`` and ``moe_chip.py``
measure minifield's experts against: Mixtral's routing (FP32 router, softmax, top k
renormalised), the (token, expert) pairs sorted by expert and the tokens gathered, one grouped
product per projection against the experts held stacked ``[E, in, out]`` (``ragged_dot``,
minifield's grouped product or megablox's ``gmm``), weighted and scatter-added back; or every
expert on every token (:func:`dense_mlp`). Each is an ``mlp`` for :func:`minimal.llama.logits`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from minifield.models.layers import grouped, tpu_grouped
from minimal import llama as minimal

F32 = jnp.float32
#: experts each token goes to (Mixtral's 2); the learning-rate schedule's length
TOP_K, MAX_STEPS = 2, 1000


def stacked_mlp(block: dict) -> dict:
    """A minifield block's router and (stacked) experts in :mod:`minimal.llama`'s names."""
    experts = block["moe"]["experts"]
    return {
        "router": jnp.array(block["moe"]["router"]),
        **{k: jnp.array(experts[n]) for k, n in minimal.MLP_NAMES.items()},
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
