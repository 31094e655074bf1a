"""One grpo update on the device: ``num_iterations`` optimizer steps on one batch of rollouts.

``make_update(...)`` returns ``update(state, batch) -> (state, metrics, logps)`` (with LoRA
``update(state, base, batch)``, the frozen base between them as in every LoRA update of the
language-model program). The batch is a :class:`.rollouts_file.Batch`: the update's rows (``tokens [N, S]``:
prompt then completion), ``mask`` (1 on completion tokens that count), ``weights`` (each
token's share of the loss, :func:`minifield.rl.advantages.token_weights`), ``advantages [N]``
and, with ``beta`` > 0, ``ref_logps [N, S]`` (else None: no array, one compiled shape). Iteration 1 takes the rollout policy's log-probabilities as its own,
stop-gradient (so its ratio is exactly 1), and returns them: iterations 2 … μ clip their
ratios against those. The state's ``step`` advances by one per update (checkpoints and
resumes fall between updates, never inside one), the optimizer's count by μ.

Gradient accumulation (``training.grad_accum_steps`` k > 1): each of the μ optimizer steps
takes its gradient as the sum over k micro-batches of every k-th row (:func:`_accumulated`,
the language-model program's one accumulation,
:func:`minifield.training.train_step.micro_batch_sums`),
the same program on one device or on a data-parallel mesh (the batch's rows split over
``data``, :meth:`minifield.strategies.grpo.program.GRPOProgram.compile`).

Metrics, each over the whole update whatever its micro-batches: ``loss`` (iteration 1's: the
rollout policy's, recomputable from the rollouts file),
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
from ...training import lora, train_step

#: objective metric → update metric, the clipped fractions averaged over the iterations
CLIP_METRICS = {
    "clip_ratio/low_mean": "clip_low",
    "clip_ratio/high_mean": "clip_high",
    "clip_ratio/region_mean": "clip_region",
}


def make_update(
    cfg,
    optimizer,
    schedule,
    settings,
    iterations: int,
    temperature: float,
    lora_settings=None,
    accum_steps: int = 1,
):
    """See the module. ``accum_steps`` k > 1 (``training.grad_accum_steps``): every optimizer
    step's gradient is the sum of k micro-batches' gradients (:func:`_accumulated`)."""

    def loss_of(trained, base, batch, old_NxS, use_old):
        params = trained if lora_settings is None else lora.adapted(base, trained, lora_settings)
        logps_NxS, entropy_NxS = logprobs.token_logps(params, cfg, batch.tokens, temperature)
        old_NxS = jnp.where(use_old, old_NxS, jax.lax.stop_gradient(logps_NxS))
        loss, metrics = objective.objective_value(
            settings,
            logps_NxS,
            old_NxS,
            batch.ref_logps,
            batch.advantages,
            batch.mask,
            batch.weights,
        )
        metrics["entropy_sum"] = jnp.sum(entropy_NxS * batch.mask)
        return loss, (metrics, logps_NxS)

    def gradient(params, base, batch, old_NxS, use_old):
        """``(loss, parts, logps_NxS, grads)`` of the whole batch; ``parts`` each metric of
        :func:`objective.objective_value` (with ``entropy_sum``) over the whole batch."""
        if accum_steps == 1:
            (loss, (parts, logps_NxS)), grads = jax.value_and_grad(loss_of, has_aux=True)(
                params, base, batch, old_NxS, use_old
            )
            return loss, parts, logps_NxS, grads
        return _accumulated(loss_of, params, base, batch, old_NxS, use_old, accum_steps, settings)

    def one_step(params, opt_state, base, batch, old_NxS, use_old):
        loss, parts, logps_NxS, grads = gradient(params, base, batch, old_NxS, use_old)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        return params, opt_state, loss, parts, logps_NxS, optax.tree.norm(grads)

    def update(state, batch, base):
        params, opt_state = state["params"], state["opt_state"]
        mask_NxS = batch.mask
        zeros_NxS = jnp.zeros(mask_NxS.shape, jnp.float32)
        params, opt_state, loss, first, logps_NxS, grad_norm = one_step(
            params, opt_state, base, batch, zeros_NxS, False
        )
        old_NxS = jax.lax.stop_gradient(logps_NxS)
        clipped = {k: first[k] for k in CLIP_METRICS}
        last_loss = loss
        # μ is small (TRL's default is 1): unrolled, one compiled program per recipe
        for _ in range(iterations - 1):
            params, opt_state, last_loss, later, _, _ = one_step(
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
            "entropy": first["entropy_sum"] / tokens,
            "learning_rate": jnp.asarray(schedule(state["step"] * iterations), jnp.float32),
            **{name: clipped[k] / iterations for k, name in CLIP_METRICS.items()},
        }
        return new_state, metrics, old_NxS

    if lora_settings is None:
        return lambda state, batch: update(state, batch, None)
    return lambda state, base, batch: update(state, batch, base)


#: the objective's means: kl over active tokens, the clip shares over active tokens (the
#: "token" level) or sequences ("sequence")
MEANS = ("kl", *CLIP_METRICS)


def _accumulated(loss_of, params, base, batch, old_NxS, use_old, k: int, settings):
    """``(loss, parts, logps_NxS, grads)`` of the whole batch from ``k`` micro-batches.

    Micro-batch ``m`` holds every k-th row from row ``m``
    (:func:`minifield.training.train_step.micro_batches`: on a data-parallel mesh a device's
    rows hold rows of every micro-batch, so nothing moves between devices), the split bnpo's
    token weights assume. The weights already normalise over the whole update, so the sum of
    the micro-batches' losses and gradients *is* the update's: nothing is divided afterwards.
    ``lax.scan`` holds one micro-batch's activations at a time. The metrics combine exactly:
    a token mean weighted by the micro-batches' active tokens, a sequence mean (GSPO's clip
    shares) by their sequences; the log-probabilities come back in row order."""

    def value_and_grad(p, micro):
        micro_batch, micro_old = micro
        return jax.value_and_grad(loss_of, has_aux=True)(p, base, micro_batch, micro_old, use_old)

    loss, grads, (parts_k, logps_kxBxS) = train_step.micro_batch_sums(
        value_and_grad, params, (batch, old_NxS), k
    )
    logps_NxS = train_step.rows_in_order(logps_kxBxS)
    tokens, sequences = parts_k["tokens"].sum(), parts_k["sequences"].sum()
    parts = {"tokens": tokens, "sequences": sequences, "entropy_sum": parts_k["entropy_sum"].sum()}
    sequence_level = settings.importance_sampling_level == "sequence"
    for name in MEANS:
        if name not in parts_k:
            continue
        # kl is a token mean at either level; the clip shares a sequence mean at "sequence"
        counts_k = parts_k["sequences" if sequence_level and name != "kl" else "tokens"]
        parts[name] = (parts_k[name] * counts_k).sum() / jnp.maximum(counts_k.sum(), 1.0)
    # NaN (no completion counted) is left out, as the objective's own nanmin / nanmax
    parts["clip_ratio/low_min"] = jnp.nanmin(parts_k["clip_ratio/low_min"])
    parts["clip_ratio/high_max"] = jnp.nanmax(parts_k["clip_ratio/high_max"])
    return loss, parts, logps_NxS, grads


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
