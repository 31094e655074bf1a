"""The router's training losses of a mixture-of-experts model, and the experts' load.

From the router logits of the sparse layers ``[L, N, E]`` (FP32, :func:`.llama.hidden` with
``router``) and the token mask ``[N]`` (1 for a token, 0 for padding: the packed rows'
``segments != 0``, transformers' ``attention_mask``):

- the load-balancing loss (``output_router_logits`` true in the base's ``config.json``):
  transformers' ``load_balancing_loss_func`` (:func:`.moe.load_balancing_loss`), the layers
  pooled; ``router_aux_loss_coef`` times it is added to the language-model loss, as
  ``MixtralForCausalLM``, ``Qwen2MoeForCausalLM``, ``Qwen3MoeForCausalLM`` and
  ``OlmoeForCausalLM`` add it;
- the router z-loss (ST-MoE, Zoph et al. 2022, eq. 5): the mean over the unmasked
  (layer, token) pairs of ``logsumexp(logits)^2``, pooled over the layers as the
  load-balancing loss is; ``model.router_z_loss_coef`` times it is added;
- the experts' load: per expert, the share of the routed (layer, token, choice) triples that
  chose it (pooled over the sparse layers and the ``k`` choices; it sums to 1). Pooled, not per
  layer, because the load-balancing loss pools the same way (its ``f`` summed over the
  choices) and an update event then carries ``E`` numbers, not ``L * E``.

Either loss being asked for computes both and the load; only the asked ones are added (an
unused coefficient adds nothing, and the other value is reported for comparison).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from . import moe
from .layers.primitives import F32

#: the scalars :func:`terms` returns: each weighs, under gradient accumulation, as its
#: micro-batch's trained tokens do (:func:`minifield.training.train_step.accumulated_gradient`)
SCALARS = ("router_loss", "router_aux_loss", "router_z_loss")
#: the per-expert routed counts :func:`terms` returns (summed over micro-batches), reported
#: as the load :func:`expert_load`
COUNTS = "expert_counts"


def enabled(cfg) -> bool:
    """Whether ``cfg``'s training loss has router terms (a model with experts asked for
    the load-balancing loss or the z-loss)."""
    if not getattr(cfg, "n_experts", 0):
        return False
    return cfg.router_aux_coef is not None or cfg.router_z_coef > 0


def z_loss(logits_LxNxE, mask_N):
    """ST-MoE's router z-loss, FP32 scalar: ``logsumexp`` of each (layer, token)'s logits,
    squared, averaged over the unmasked tokens of every layer (0 when every token is masked)."""
    L, N, _ = logits_LxNxE.shape
    log_z_LxN = jax.nn.logsumexp(logits_LxNxE.astype(F32), axis=-1)
    mask_LxN = jnp.broadcast_to(mask_N.astype(F32), (L, N))
    return jnp.sum(jnp.square(log_z_LxN) * mask_LxN) / jnp.maximum(jnp.sum(mask_LxN), 1.0)


def expert_counts(cfg, logits_LxNxE, mask_N):
    """``[E]`` FP32: how many unmasked (layer, token, choice) triples chose each expert (the
    top ``k`` of the softmax, as the forward routes)."""
    L, N, E = logits_LxNxE.shape
    probs_LxNxE = jax.nn.softmax(logits_LxNxE.astype(F32), axis=-1)  # as the forward routes
    _, chosen_LxNxK = jax.lax.top_k(probs_LxNxE, cfg.experts_per_token)
    onehot_LxNxKxE = jax.nn.one_hot(chosen_LxNxK, E, dtype=F32)
    mask_LxN = jnp.broadcast_to(mask_N.astype(F32), (L, N))
    return jnp.einsum("lnke,ln->e", onehot_LxNxKxE, mask_LxN)


def terms(cfg, logits_LxNxE, mask_N) -> dict:
    """The router's terms of one forward: ``router_aux_loss``, ``router_z_loss`` (FP32
    scalars), ``router_loss`` (what is added to the language-model loss: each asked loss
    times its coefficient) and ``expert_counts`` (:func:`expert_counts`)."""
    aux = moe.load_balancing_loss(cfg, logits_LxNxE, mask_N)
    z = z_loss(logits_LxNxE, mask_N)
    added = jnp.zeros((), F32)
    if cfg.router_aux_coef is not None:
        added = added + cfg.router_aux_coef * aux
    if cfg.router_z_coef:
        added = added + cfg.router_z_coef * z
    return {
        "router_loss": added,
        "router_aux_loss": aux,
        "router_z_loss": z,
        COUNTS: expert_counts(cfg, logits_LxNxE, mask_N),
    }


def expert_load(metrics: dict) -> dict:
    """``metrics`` with its ``expert_counts`` replaced by ``expert_load``, the counts'
    shares (summing to 1); unchanged without them (a dense model)."""
    if COUNTS not in metrics:
        return metrics
    out = dict(metrics)
    counts_E = out.pop(COUNTS)
    out["expert_load"] = counts_E / jnp.maximum(jnp.sum(counts_E), 1.0)
    return out
