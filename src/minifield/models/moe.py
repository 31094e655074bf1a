"""The mixture-of-experts MLP (Mixtral's ``block_sparse_moe``, Qwen2-MoE's, Qwen3-MoE's and
OLMoE's sparse ``mlp``), over the tokens of a packed batch.

Routing, as transformers' ``MixtralSparseMoeBlock`` (and the Qwen-MoE and OLMoE blocks):
router logits ``x @ router`` (FP32, ``[N, E]``), a softmax over all ``E`` experts, the ``k``
largest probabilities kept and, with ``norm_topk`` (Mixtral always; the others'
``norm_topk_prob``), divided by their sum; each token goes through its ``k`` experts
(``down(silu(gate(x)) * up(x))``, the dense MLP's form) and their outputs are summed with
those weights. Qwen2-MoE adds a shared expert on every token, times
``sigmoid(x @ shared_gate)``. A token's result depends on that token alone, so packed
segments and padding need nothing here.

Compute: grouped, dropless. The ``N * k`` (token, expert) pairs are sorted by expert (stable,
so ties keep token order), the tokens gathered in that order, and each of the three
projections is one grouped product (:func:`.layers.grouped.matmul`) of the ``[N * k, in]``
rows against the stacked ``[E, in, out]`` expert matrices with per-expert group sizes: every
expert multiplies only the rows routed to it, tile by tile, and no token is dropped (no
capacity factor, so the result does not depend on what else is in the batch). The outputs are
weighted and scattered back onto their tokens with an add. ``jax.lax.ragged_dot`` computes the
same, but on CPU the pinned JAX lowers it to every expert times every row under a mask (see
:mod:`.layers.grouped`).

The experts are held stacked (``moe/experts/w_gate`` ``[E, D, F]``, ``w_up`` ``[E, D, F]``,
``w_down`` ``[E, F, D]``), in the parameters and the train state alike, so a step neither
stacks them nor slices their gradients apart; the checkpoint's one tensor per expert is
stacked on loading and sliced again on export (:mod:`.families`' expert slots). Matrix inputs
are rounded to the compute dtype and accumulated in FP32, forward and backward, as
:func:`minifield.models.layers.primitives.einsum`; the experts' gradients stay FP32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .layers import grouped
from .layers.primitives import F32, LoraWeight, einsum, full_precision, linear


def holds_experts(path) -> bool:
    """Whether the leaf at ``path`` (a key path of :func:`jax.tree_util.tree_map_with_path`:
    the parameters, or an optimizer's moments of them) is the experts' stacked matrices
    (``moe/experts/w_gate`` ...), the experts along its first axis after any layers' axis."""
    keys = [getattr(key, "key", None) for key in path]
    return keys[-2:-1] == ["experts"] and keys[-1] in ("w_gate", "w_up", "w_down")


def _f32_product(x, w):
    return jnp.einsum("nd,de->ne", x.astype(F32), w.astype(F32), precision=full_precision(F32))


def router_logits(x_NxD, router_DxE):
    """The router's FP32 logits ``[N, E]`` (with a LoRA adapter, :class:`LoraWeight`: plus
    ``scale * (x @ a) @ b``, FP32 too)."""
    if isinstance(router_DxE, LoraWeight):
        down_NxR = _f32_product(x_NxD, router_DxE.a)
        delta_NxE = _f32_product(down_NxR, router_DxE.b)
        return _f32_product(x_NxD, router_DxE.base) + router_DxE.scale * delta_NxE
    return _f32_product(x_NxD, router_DxE)


def route_logits(cfg, logits_NxE):
    """``(weights [N, k] FP32, experts [N, k] int32)`` from the router's logits: the softmax
    over every expert's FP32 logit, its top ``k``, renormalised to sum to one with
    ``norm_topk`` (Mixtral's order)."""
    probs_NxE = jax.nn.softmax(logits_NxE, axis=-1)
    weights_NxK, experts_NxK = jax.lax.top_k(probs_NxE, cfg.experts_per_token)
    if cfg.norm_topk:
        weights_NxK = weights_NxK / jnp.sum(weights_NxK, axis=-1, keepdims=True)
    return weights_NxK, experts_NxK.astype(jnp.int32)


def moe_mlp(cfg, x_BxTxD, p, with_logits: bool = False):
    """The experts' weighted output ``[B, T, D]`` (compute dtype) for every token;
    ``p``: ``{"router": [D, E], "experts": {w_gate, w_up, w_down}}``, the experts stacked
    ``[E, in, out]`` in the parameters' dtype (the grouped product rounds them to the compute
    dtype; their gradients stay in that one) (Qwen2-MoE: and
    ``"shared": {w_gate, w_up, w_down}``, ``"shared_gate": [D, 1]``). Under LoRA
    (:mod:`minifield.training.lora`) the router and the shared expert's matrices may be
    :class:`LoraWeight`, and ``"experts_lora": {w_gate|w_up|w_down: LoraWeight}`` holds the
    experts' stacked adapters (``base`` None). ``with_logits``: the pair (output, the
    router's FP32 logits ``[B * T, E]``), which the router's training losses read
    (:mod:`.router_loss`)."""
    B, T, D = x_BxTxD.shape
    E, K = cfg.n_experts, cfg.experts_per_token
    x_NxD = x_BxTxD.reshape(B * T, D)
    # the scopes name the stages in the compiled program's metadata (benchmarks/moe_census.py
    # sums the kernels of each); they change no computation
    with jax.named_scope("moe_router"):
        logits_NxE = router_logits(x_NxD, p["router"])
        weights_NxK, experts_NxK = route_logits(cfg, logits_NxE)
    with jax.named_scope("moe_sort"):
        flat_M = experts_NxK.reshape(-1)  # M = N * K (token, expert) pairs, token-major
        order_M = jnp.argsort(flat_M, stable=True)
        token_M = order_M // K
        group_sizes_E = jnp.bincount(flat_M, length=E).astype(jnp.int32)
    with jax.named_scope("moe_gather"):
        xs_MxD = x_NxD[token_M].astype(cfg.dtype)

    def product(lhs, rhs_ExIxO):
        return grouped.matmul(cfg, lhs, rhs_ExIxO, group_sizes_E)

    def experts(lhs, name):
        out = product(lhs, p["experts"][name])
        lora = p.get("experts_lora", {}).get(name)
        if lora is None:
            return out
        # LoRA (``experts_lora``: stacked a [E, in, r], b [E, r, out]): the same groups, so
        # each row meets only its own expert's adapter; the inner product rounded to the
        # compute dtype, as a dense layer's (primitives.linear)
        down_MxR = product(lhs, lora.a).astype(cfg.dtype)
        return out + lora.scale * product(down_MxR, lora.b)

    with jax.named_scope("moe_experts"):
        gate_MxF = experts(xs_MxD, "w_gate")
        up_MxF = experts(xs_MxD, "w_up")
        act_MxF = (jax.nn.silu(gate_MxF) * up_MxF).astype(cfg.dtype)
        out_MxD = experts(act_MxF, "w_down").astype(cfg.dtype).astype(F32)
    with jax.named_scope("moe_scatter"):
        weighted_MxD = out_MxD * weights_NxK.reshape(-1)[order_M][:, None]
        y_NxD = jnp.zeros((B * T, D), F32).at[token_M].add(weighted_MxD)
        y_BxTxD = y_NxD.astype(cfg.dtype).reshape(B, T, D)
    if "shared" in p:  # Qwen2-MoE: every token, gated by sigmoid(x @ shared_gate)
        y_BxTxD = (y_BxTxD.astype(F32) + _shared(cfg, x_BxTxD, p)).astype(cfg.dtype)
    return (y_BxTxD, logits_NxE) if with_logits else y_BxTxD


def _shared(cfg, x_BxTxD, p):
    """The shared expert's output times its sigmoid gate, FP32 ``[B, T, D]``."""
    s = p["shared"]
    gate_BxTxF = linear(cfg, x_BxTxD, s["w_gate"])
    up_BxTxF = linear(cfg, x_BxTxD, s["w_up"])
    act_BxTxF = (jax.nn.silu(gate_BxTxF) * up_BxTxF).astype(cfg.dtype)
    out_BxTxD = linear(cfg, act_BxTxF, s["w_down"]).astype(cfg.dtype).astype(F32)
    gate_BxTx1 = einsum(cfg, "btd,do->bto", x_BxTxD, p["shared_gate"], out_dtype=F32)
    return jax.nn.sigmoid(gate_BxTx1) * out_BxTxD


def load_balancing_loss(cfg, logits_LxNxE, mask_N=None):
    """transformers' ``load_balancing_loss_func`` (Switch Transformer's eqs. 4-6), FP32 scalar:
    the router logits of every sparse layer pooled (not a per-layer sum), a softmax and the
    top ``k`` of each; ``f[k, e]``: the share of (layer, token) pairs whose ``k``-th choice is
    expert ``e``, ``P[e]``: the mean probability of ``e``; the loss is
    ``E * sum_{k, e} f[k, e] * P[e]``. ``mask_N`` (1 for a token, 0 for padding: the packed
    rows' ``segments != 0``) leaves padding out of both means, as transformers'
    ``attention_mask``. The training loss adds it with ``output_router_logits``
    (:mod:`.router_loss`)."""
    L, N, E = logits_LxNxE.shape
    probs_LxNxE = jax.nn.softmax(logits_LxNxE.astype(F32), axis=-1)
    _, chosen_LxNxK = jax.lax.top_k(probs_LxNxE, cfg.experts_per_token)
    onehot_LxNxKxE = jax.nn.one_hot(chosen_LxNxK, E, dtype=F32)
    mask_LxN = jnp.ones((L, N), F32) if mask_N is None else jnp.broadcast_to(mask_N, (L, N))
    mask_LxN = mask_LxN.astype(F32)
    count = jnp.maximum(jnp.sum(mask_LxN), 1.0)  # every token masked: 0, not NaN
    f_KxE = jnp.einsum("lnke,ln->ke", onehot_LxNxKxE, mask_LxN) / count
    p_E = jnp.einsum("lne,ln->e", probs_LxNxE, mask_LxN, precision=full_precision(F32)) / count
    return E * jnp.sum(f_KxE * p_E[None, :])
