"""The packed-SFT train step: one pure function over the complete training state.

State layout (the same complete-state parts as every strategy, see ``state.py``)::

    {"params": FP32 pytree, "opt_state": optax state, "rng": uint32 key data,
     "step": int32 scalar (updates applied), "cursor": int32 scalar (rows consumed)}

``make_train_step(cfg, optimizer)`` returns ``train_step(state, batch) -> (state, metrics)``,
meant to be compiled once with ``jax.jit(train_step, donate_argnums=(0,))``. The batch is
``{"tokens", "segments", "positions": int32 [B, T], "loss_mask": float32 or int32 [B, T]}``.
Layer layout: per layer (``params/blocks/00/...``, and the same in each optimizer moment)
by default; with ``model.scan_layers`` the state holds the blocks stacked
(``params/blocks/stacked/...`` with a leading layer axis, :func:`.layer_stack.stack_layers`),
so the compiled update holds no per-layer code and compiles in a time independent of depth.
Checkpoints and state hashes of a scanned run are of that layout; evaluation and exports see
the per-layer one (:func:`.layer_stack.per_layer`). The model has no dropout, so ``rng`` is
carried unchanged; it stays in the state so a
stochastic variant would remain resumable. ``cursor`` advances by B per update.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax

from . import layer_stack
from .model import ModelConfig, init_params, loss_fn


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


def make_train_step(
    cfg: ModelConfig,
    optimizer: optax.GradientTransformation,
    schedule: Callable | None = None,
    objective: Callable = loss_fn,
):
    """The pure update ``(state, batch) -> (state, metrics)``.

    Metrics (device scalars, FP32): ``loss`` (mean over counted targets), ``loss_sum``,
    ``tokens`` (counted targets), ``grad_norm`` (global norm before clipping) and, when
    ``schedule`` (see ``optimizer.make_schedule``) is given, ``learning_rate`` of this update.
    ``objective(params, cfg, batch) -> (loss, aux)`` is differentiated with respect to
    ``state["params"]`` (:mod:`.lora` passes one that adds its adapters to a frozen base).

    A stacked state (:func:`init_train_state` with ``cfg.execution.scan_layers``) stays
    stacked: the model scans its blocks, the gradient comes out stacked, and clipping and
    AdamW run once per stacked leaf (the same global norm and the same per-element update as
    per layer, see :mod:`.optimizer`'s weight-decay mask).
    """

    def train_step(state: dict, batch: dict) -> tuple[dict, dict]:
        params = state["params"]
        (loss, aux), grads = jax.value_and_grad(objective, has_aux=True)(params, cfg, batch)
        updates, opt_state = optimizer.update(grads, state["opt_state"], params)
        new_state = {
            "params": optax.apply_updates(params, updates),
            "opt_state": opt_state,
            "rng": state["rng"],
            "step": state["step"] + 1,
            "cursor": state["cursor"] + jnp.int32(batch["tokens"].shape[0]),
        }
        metrics = {
            "loss": loss,
            "loss_sum": aux["loss_sum"],
            "tokens": aux["tokens"],
            "grad_norm": optax.tree.norm(grads),
        }
        if schedule is not None:
            metrics["learning_rate"] = jnp.asarray(schedule(state["step"]), jnp.float32)
        return new_state, metrics

    return train_step
