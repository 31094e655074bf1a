"""The packed-SFT train step: one pure function over the complete training state.

State layout (the same complete-state parts as every strategy, see ``state.py``)::

    {"params": FP32 pytree, "opt_state": optax state, "rng": uint32 key data,
     "step": int32 scalar (updates applied), "cursor": int32 scalar (rows consumed)}

``make_train_step(cfg, optimizer)`` returns ``train_step(state, batch) -> (state, metrics)``,
meant to be compiled once with ``jax.jit(train_step, donate_argnums=(0,))``. The batch is
the objective's (a NamedTuple, rows first): packed rows, :class:`minifield.data.packing.Rows`,
by default.
Layer layout: per layer (``params/blocks/00/...``, and the same in each optimizer moment)
by default; with ``model.scan_layers`` the state holds the blocks stacked
(``params/blocks/stacked/...`` with a leading layer axis, :func:`minifield.models.layers.layer_stack.stack_layers`),
so the compiled update holds no per-layer code and compiles in a time independent of depth.
Checkpoints and state hashes of a scanned run are of that layout; evaluation and exports see
the per-layer one (:func:`minifield.models.layers.layer_stack.per_layer`). The model has no dropout, so ``rng`` is
carried unchanged; it stays in the state so a
stochastic variant would remain resumable. ``cursor`` advances by B per update (with gradient
accumulation too: B is the update's rows, over all its micro-batches).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import optax

from ..models import router_loss
from ..models.layers import layer_stack
from ..models.model import ModelConfig, init_params, loss_fn


def init_train_state(cfg: ModelConfig, optimizer: optax.GradientTransformation, seed: int) -> dict:
    """Fresh complete state for step 0; parameters come from ``fold_in(key(seed), 0)``.

    With ``cfg.execution.scan_layers`` the blocks are held stacked (see the module docstring)."""
    key = jax.random.key(seed)
    params = init_params(cfg, jax.random.fold_in(key, 0))
    if layer_stack.holds_stacked(cfg):
        params = layer_stack.stack_layers(params)
    return {
        "params": params,
        "opt_state": optimizer.init(params),
        "rng": jax.random.key_data(key),
        "step": jnp.zeros((), jnp.int32),
        "cursor": jnp.zeros((), jnp.int32),
    }


def micro_batches(batch, k: int):
    """``[B, ...]`` rows as ``[k, B / k, ...]``: micro-batch ``i`` holds rows ``i, i + k, ...``
    (``batch``: any pytree of arrays with rows first, a strategy's batch).

    Taking every k-th row (not k contiguous blocks) keeps each device's rows on that device
    under data parallelism: a device's contiguous block of ``B / N`` rows holds ``B / (k N)``
    rows of every micro-batch, so splitting into micro-batches moves nothing between devices.
    """
    return jax.tree_util.tree_map(
        lambda value: value.reshape(value.shape[0] // k, k, *value.shape[1:]).swapaxes(0, 1),
        batch,
    )


def rows_in_order(value_kxB):
    """:func:`micro_batches`' inverse for one per-row output ``[k, B / k, ...]``: ``[B, ...]``."""
    k, rows = value_kxB.shape[:2]
    return value_kxB.swapaxes(0, 1).reshape(k * rows, *value_kxB.shape[2:])


def micro_batch_sums(value_and_grad: Callable, params, batch, k: int):
    """``(total, grads, aux_k)`` of ``batch`` over ``k`` micro-batches (:func:`micro_batches`):
    ``value_and_grad(params, micro) -> ((value, aux), grads)``; the values and the gradients
    summed in micro-batch order, each ``aux`` entry stacked ``[k, ...]`` for the caller to
    combine. ``lax.scan`` holds one micro-batch's activations at a time. The one
    accumulation of every strategy's update (the supervised and preference losses,
    :func:`accumulated_gradient`; grpo's, :mod:`minifield.strategies.grpo.update`)."""

    def one(carry, micro):
        grads, total = carry
        (value, aux), g = value_and_grad(params, micro)
        return (jax.tree_util.tree_map(jnp.add, grads, g), total + value), aux

    start = (jax.tree_util.tree_map(jnp.zeros_like, params), jnp.zeros((), jnp.float32))
    (grads, total), aux_k = jax.lax.scan(one, start, micro_batches(batch, k))
    return total, grads, aux_k


@dataclass(frozen=True)
class Accumulation:
    """How an objective's micro-batch values add up to the whole batch's.

    The objective's loss is its ``aux["loss_sum"]`` divided by ``aux[count]`` (the
    supervised loss: trained tokens; the preference losses: pairs). Every other ``aux`` entry
    adds up over micro-batches, except the ones named in ``means``: means over ``count``,
    combined weighted by each micro-batch's count."""

    count: str = "tokens"
    means: tuple[str, ...] = ()


TOKEN_MEAN = Accumulation()


def accumulated_gradient(
    objective: Callable, params, cfg, batch, k: int, how: Accumulation = TOKEN_MEAN
):
    """``(loss, aux), grads`` of the whole batch computed over ``k`` micro-batches.

    Each micro-batch contributes the gradient of its loss *sum*; the sum over micro-batches is
    divided once by the count of the whole batch (``how.count``: trained tokens unless the
    objective says otherwise). That is the full batch's mean (the same update as one batch of
    all rows, up to FP32 rounding) whenever each term of the loss depends on its own rows
    only, not a mean of per-micro-batch means, which would weigh a token of a sparse
    micro-batch more than one of a full one. ``lax.scan`` holds one micro-batch's
    activations at a time.

    The router's terms of a mixture of experts (:mod:`minifield.models.router_loss`) are
    per forward, as transformers computes them: each micro-batch's weighs as its trained
    tokens (its ``router_loss`` enters its sum times its tokens), so the update minimises the
    token-weighted mean over micro-batches of (language-model loss + router terms), and one
    micro-batch is exactly ``lm + router_loss``. The reported router losses are the same
    weighted means; the experts' counts are summed.
    """
    router = router_loss.enabled(cfg)
    means = how.means + (tuple(router_loss.SCALARS) if router else ())

    def loss_sum(p, micro):
        _, aux = objective(p, cfg, micro)
        if router:
            return aux["loss_sum"] + aux["tokens"] * aux["router_loss"], aux
        return aux["loss_sum"], aux

    def value_and_grad(p, micro):
        (value, aux), g = jax.value_and_grad(loss_sum, has_aux=True)(p, micro)
        # a mean over the micro-batch's count, as a sum over it (divided once at the end)
        aux = {name: v * aux[how.count] if name in means else v for name, v in aux.items()}
        return (value, aux), g

    total, grads, aux_k = micro_batch_sums(value_and_grad, params, batch, k)
    aux = {name: v.sum(axis=0) for name, v in aux_k.items()}
    scale = 1.0 / jnp.maximum(aux[how.count], 1.0)
    grads = jax.tree_util.tree_map(lambda g: g * scale, grads)
    aux = {name: v * scale if name in means else v for name, v in aux.items()}
    return (total * scale, aux), grads


def make_train_step(
    cfg: ModelConfig,
    optimizer: optax.GradientTransformation,
    schedule: Callable | None = None,
    objective: Callable = loss_fn,
    accum_steps: int = 1,
    accumulation: Accumulation = TOKEN_MEAN,
):
    """The pure update ``(state, batch) -> (state, metrics)``.

    Metrics (device scalars, FP32): ``loss`` (mean over counted targets), ``loss_sum``,
    ``tokens`` (counted targets), ``grad_norm`` (global norm before clipping), any further
    entry of the objective's ``aux`` (a mixture of experts' router losses and
    ``expert_load`` ``[E]``, :mod:`minifield.models.router_loss`) and, when
    ``schedule`` (see ``optimizer.make_schedule``) is given, ``learning_rate`` of this update.
    ``objective(params, cfg, batch) -> (loss, aux)`` is differentiated with respect to
    ``state["params"]`` (:mod:`.lora` passes one that adds its adapters to a frozen base).

    A stacked state (:func:`init_train_state` with ``cfg.execution.scan_layers``) stays
    stacked: the model scans its blocks, the gradient comes out stacked, and clipping and
    AdamW run once per stacked leaf (the same global norm and the same per-element update as
    per layer, see :mod:`.optimizer`'s weight-decay mask).

    ``accum_steps`` > 1 (``training.grad_accum_steps``) computes the gradient over that many
    micro-batches of the batch (:func:`accumulated_gradient`) inside the one update: the state
    never holds a partial sum, so checkpoints fall between whole updates only. 1 is the plain
    update, unchanged. ``accumulation`` says what the objective's loss is a mean over
    (:class:`Accumulation`; trained tokens by default).
    """

    def train_step(state: dict, batch) -> tuple[dict, dict]:
        params = state["params"]
        if accum_steps == 1:
            (loss, aux), grads = jax.value_and_grad(objective, has_aux=True)(params, cfg, batch)
        else:
            (loss, aux), grads = accumulated_gradient(
                objective, params, cfg, batch, accum_steps, accumulation
            )
        updates, opt_state = optimizer.update(grads, state["opt_state"], params)
        new_state = {
            "params": optax.apply_updates(params, updates),
            "opt_state": opt_state,
            "rng": state["rng"],
            "step": state["step"] + 1,
            "cursor": state["cursor"] + jnp.int32(batch.tokens.shape[0]),
        }
        metrics = {
            "loss": loss,
            "loss_sum": aux["loss_sum"],
            "tokens": aux["tokens"],
            "grad_norm": optax.tree.norm(grads),
        }
        # an objective's further scalars (the preference losses' accuracy and margins); the
        # supervised loss has none, so its metrics are unchanged
        metrics.update({k: v for k, v in aux.items() if k not in metrics})
        metrics = router_loss.expert_load(metrics)  # a mixture of experts' routed shares
        if schedule is not None:
            metrics["learning_rate"] = jnp.asarray(schedule(state["step"]), jnp.float32)
        return new_state, metrics

    return train_step
