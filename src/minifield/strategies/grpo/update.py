"""One grpo update on the device: ``num_iterations`` optimizer steps on one batch of rollouts.

``make_update(...)`` returns ``update(state, batch[, base]) -> (state, metrics, logps)``. The
batch holds the update's rows (``tokens [N, S]``: prompt then completion), ``mask`` (1 on
completion tokens that count), ``weights`` (each token's share of the loss,
:func:`minifield.rl.advantages.token_weights`), ``advantages [N]`` and, with ``beta`` > 0,
``ref_logps [N, S]``. Iteration 1 takes the rollout policy's log-probabilities as its own,
stop-gradient (so its ratio is exactly 1), and returns them: iterations 2 … μ clip their
ratios against those. The state's ``step`` advances by one per update (checkpoints and
resumes fall between updates, never inside one), the optimizer's count by μ.

Metrics: ``loss`` (iteration 1's: the rollout policy's, recomputable from the rollouts file),
``loss_final`` (iteration μ's), ``grad_norm`` (iteration 1's), ``kl`` (iteration 1's mask-mean
k3 estimate; 0 without a reference), the clipped fractions averaged over the iterations
(``clip_low``, ``clip_high``, ``clip_region``), ``entropy`` (mask-mean, iteration 1) and
``learning_rate`` (of the update's first optimizer step).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from ...rl import logprobs, objective
from ...training import lora

#: objective metric → update metric, the clipped fractions averaged over the iterations
CLIP_METRICS = {
    "clip_ratio/low_mean": "clip_low",
    "clip_ratio/high_mean": "clip_high",
    "clip_ratio/region_mean": "clip_region",
}


def make_update(
    cfg, optimizer, schedule, settings, iterations: int, temperature: float, lora_settings=None
):
    def loss_of(trained, base, batch, old_NxS, use_old):
        params = trained if lora_settings is None else lora.adapted(base, trained, lora_settings)
        logps_NxS, entropy_NxS = logprobs.token_logps(params, cfg, batch["tokens"], temperature)
        old_NxS = jnp.where(use_old, old_NxS, jax.lax.stop_gradient(logps_NxS))
        loss, metrics = objective.objective_value(
            settings,
            logps_NxS,
            old_NxS,
            batch.get("ref_logps"),
            batch["advantages"],
            batch["mask"],
            batch["weights"],
        )
        return loss, (metrics, logps_NxS, entropy_NxS)

    def one_step(params, opt_state, base, batch, old_NxS, use_old):
        (loss, (metrics, logps_NxS, entropy_NxS)), grads = jax.value_and_grad(
            loss_of, has_aux=True
        )(params, base, batch, old_NxS, use_old)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        return params, opt_state, loss, metrics, logps_NxS, entropy_NxS, optax.tree.norm(grads)

    def update(state, batch, base=None):
        params, opt_state = state["params"], state["opt_state"]
        mask_NxS = batch["mask"]
        zeros_NxS = jnp.zeros(mask_NxS.shape, jnp.float32)
        params, opt_state, loss, first, logps_NxS, entropy_NxS, grad_norm = one_step(
            params, opt_state, base, batch, zeros_NxS, False
        )
        old_NxS = jax.lax.stop_gradient(logps_NxS)
        clipped = {k: first[k] for k in CLIP_METRICS}
        last_loss = loss
        # μ is small (TRL's default is 1): unrolled, one compiled program per recipe
        for _ in range(iterations - 1):
            params, opt_state, last_loss, later, _, _, _ = one_step(
                params, opt_state, base, batch, old_NxS, True
            )
            clipped = {k: clipped[k] + later[k] for k in CLIP_METRICS}
        new_state = {
            **state,
            "params": params,
            "opt_state": opt_state,
            "step": state["step"] + 1,
            "cursor": state["cursor"] + jnp.int32(mask_NxS.shape[0]),
        }
        tokens = jnp.maximum(jnp.sum(mask_NxS), 1.0)
        metrics = {
            "loss": loss,
            "loss_final": last_loss,
            "grad_norm": grad_norm,
            "kl": first.get("kl", jnp.zeros((), jnp.float32)),
            "entropy": jnp.sum(entropy_NxS * mask_NxS) / tokens,
            "learning_rate": jnp.asarray(schedule(state["step"] * iterations), jnp.float32),
            **{name: clipped[k] / iterations for k, name in CLIP_METRICS.items()},
        }
        return new_state, metrics, old_NxS

    return update


def make_reference(cfg, temperature: float, lora_settings=None):
    """``reference(params_or_base, tokens) -> logps_NxS``: the reference policy's
    log-probabilities. With LoRA it takes the frozen base and the adapters' tree, and runs the
    base with a zero in place of every adapter's contribution (the base model, no copy of
    it); else the starting weights it is given."""

    def reference(params, tokens_NxS):
        return logprobs.token_logps(params, cfg, tokens_NxS, temperature)[0]

    if lora_settings is None:
        return jax.jit(reference)

    def base_reference(base, adapters, tokens_NxS):
        zero = jax.tree_util.tree_map(jnp.zeros_like, adapters)
        return reference(lora.adapted(base, zero, lora_settings), tokens_NxS)

    return jax.jit(base_reference)
