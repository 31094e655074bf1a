"""The GRPO policy objective: pure JAX functions of per-token log-probabilities, in float32.

Per completion ``i`` and completion token ``t`` (``mask_NxT`` 1 on the completion's tokens,
0 on padding), the policy's log-probability ``logps``, the sampling policy's ``old_logps`` and,
with a KL term, the reference model's ``ref_logps``; one advantage ``adv_N`` per completion
(:func:`minifield.rl.advantages.advantages`). As TRL's ``GRPOTrainer._compute_loss``:

- the importance ratio, per token ``r = exp(logps − old_logps)`` (``importance_sampling_level
  "token"``) or per sequence, GSPO's ``s_i = exp(Σ_t mask·(logps − old_logps) / max(len_i, 1))``
  broadcast over the sequence's tokens (``"sequence"``);
- the clipped surrogate ``−min(r·A, clip(r, 1 − ε, 1 + ε_high)·A)``;
- plus ``β·k3`` with Schulman's ``k3 = exp(ref − logps) − (ref − logps) − 1`` when ``β ≠ 0``.

The loss of an update is ``Σ weights · per_token_loss`` with the loss type's token weights
(:func:`minifield.rl.advantages.token_weights`), so micro-batches' losses add up to it.
``settings`` steers Python control flow (the KL term, the ratio's level): close over it or pass
it as a static argument of ``jax.jit`` (a NamedTuple is hashable). docs/grpo-objective.md
writes the formulas out.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

__all__ = [
    "IMPORTANCE_SAMPLING_LEVELS",
    "LossSettings",
    "objective_value",
    "per_token_loss",
]

#: where the importance ratio is taken (TRL's ``importance_sampling_level``)
IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")
HIGHEST = jax.lax.AccuracyMode.HIGHEST


class LossSettings(NamedTuple):
    """The objective's settings (TRL's names; their defaults are the recipe schema's)."""

    #: the k3 KL term's coefficient (0: no term, no reference model read)
    beta: float
    #: the ratio's lower clip ``1 − epsilon``
    epsilon: float
    #: the ratio's upper clip ``1 + epsilon_high`` (DAPO's clip-higher; TRL: epsilon when unset)
    epsilon_high: float
    #: ``"token"`` (GRPO) or ``"sequence"`` (GSPO)
    importance_sampling_level: str


def per_token_loss(
    settings: LossSettings, logps_NxT, old_logps_NxT, ref_logps_NxT, adv_N, mask_NxT
):
    """``(loss_NxT, parts)``: each completion token's loss and its parts, 0 on padding.

    ``old_logps_NxT`` None is the update's first iteration, on the policy that sampled: it is
    ``stop_gradient(logps_NxT)``, so the ratio is exactly 1 and its gradient is ``∇logps`` (TRL
    does the same when ``num_iterations == 1``: ``per_token_logps.detach()``).

    At the ``"sequence"`` level the ratio's gradient flows through the mean of the sequence's
    log-ratios to each of its tokens, as TRL's ``importance_sampling_level="sequence"`` (no
    stop-gradient: TRL's detached form, ``logps − sg(logps) + sg(log s_i)``, is the separate
    experimental GSPO-token and is not offered here).

    ``parts``: ``kl`` (the per-token k3, zeros when ``beta == 0``, when ``ref_logps_NxT`` may be
    None), ``is_low_clipped`` (``r < 1 − ε`` and ``A < 0``), ``is_high_clipped`` (``r > 1 + ε_high``
    and ``A > 0``) and ``is_region_clipped`` (either): the tokens whose surrogate is the clipped
    one, so whose policy gradient is 0; TRL's metric definitions.
    """
    if settings.importance_sampling_level not in IMPORTANCE_SAMPLING_LEVELS:
        raise ValueError(
            f"importance_sampling_level must be one of {IMPORTANCE_SAMPLING_LEVELS}, "
            f"got {settings.importance_sampling_level!r}"
        )
    logps_NxT = jnp.asarray(logps_NxT, jnp.float32)
    if old_logps_NxT is None:
        old_logps_NxT = jax.lax.stop_gradient(logps_NxT)
    active_NxT = jnp.asarray(mask_NxT) > 0
    mask_NxT = active_NxT.astype(jnp.float32)
    adv_Nx1 = jnp.asarray(adv_N, jnp.float32)[:, None]
    # Padding positions may hold anything (−inf, garbage): zero their log-ratio before exp, so
    # neither the value nor the gradient (0·inf) of an active token can become NaN.
    log_ratio_NxT = jnp.where(active_NxT, logps_NxT - jnp.asarray(old_logps_NxT, jnp.float32), 0.0)
    if settings.importance_sampling_level == "token":
        log_weight_NxT = log_ratio_NxT
    else:
        len_N = jnp.maximum(mask_NxT.sum(axis=1), 1.0)
        log_weight_N = (log_ratio_NxT * mask_NxT).sum(axis=1) / len_N
        log_weight_NxT = jnp.broadcast_to(log_weight_N[:, None], logps_NxT.shape)
    coef_1_NxT = jnp.exp(log_weight_NxT)
    coef_2_NxT = jnp.clip(coef_1_NxT, 1.0 - settings.epsilon, 1.0 + settings.epsilon_high)
    loss_NxT = -jnp.minimum(coef_1_NxT * adv_Nx1, coef_2_NxT * adv_Nx1)
    if settings.beta != 0.0:
        ref_minus_NxT = jnp.where(
            active_NxT, jnp.asarray(ref_logps_NxT, jnp.float32) - logps_NxT, 0.0
        )
        # TRL's exp(d) − d − 1, as expm1(d) − d: in float32 the − 1 cancels most bits of a
        # small KL (at d = 0.01 a relative error of 3e-3 against expm1's 6e-5)
        kl_NxT = _expm1(ref_minus_NxT) - ref_minus_NxT
        loss_NxT = loss_NxT + settings.beta * kl_NxT
    else:
        kl_NxT = jnp.zeros_like(logps_NxT)
    is_low_NxT = active_NxT & (coef_1_NxT < 1.0 - settings.epsilon) & (adv_Nx1 < 0)
    is_high_NxT = active_NxT & (coef_1_NxT > 1.0 + settings.epsilon_high) & (adv_Nx1 > 0)
    parts = {
        "kl": jnp.where(active_NxT, kl_NxT, 0.0),
        "is_low_clipped": is_low_NxT,
        "is_high_clipped": is_high_NxT,
        "is_region_clipped": is_low_NxT | is_high_NxT,
    }
    return jnp.where(active_NxT, loss_NxT, 0.0), parts


def _masked_mean(x_NxT, mask_NxT):
    """Mean over the active tokens (0 when there are none: TRL's ``clamp(min=1.0)``)."""
    return (x_NxT * mask_NxT).sum() / jnp.maximum(mask_NxT.sum(), 1.0)


def _clip_shares(clipped_NxT, mask_NxT, level: str):
    """``(mean, share_N, counted_N)`` of a clipped-token flag as TRL's metrics read it: at the
    token level the active tokens' share, per completion over its tokens (counted when it has
    any: TRL's per-completion share of an empty one is NaN, left out by its ``nanmin``); at the
    sequence level one flag per sequence, every sequence counted (an empty one is never
    clipped: its ratio is exp(0))."""
    clipped_NxT = clipped_NxT.astype(jnp.float32)
    n = clipped_NxT.shape[0]
    if level == "sequence":
        share_N = clipped_NxT.max(axis=1, initial=0.0)
        mean = share_N.sum() / max(n, 1)
        return mean, share_N, jnp.ones((n,), bool)
    len_N = mask_NxT.sum(axis=1)
    share_N = clipped_NxT.sum(axis=1) / jnp.maximum(len_N, 1.0)
    return _masked_mean(clipped_NxT, mask_NxT), share_N, len_N > 0


def objective_value(
    settings: LossSettings, logps_NxT, old_logps_NxT, ref_logps_NxT, adv_N, mask_NxT, weights_NxT
):
    """``(loss, metrics)``: ``loss = Σ weights · per_token_loss`` and the batch's scalar metrics,
    as TRL logs them:

    - ``kl``: the active tokens' mean k3 (only with ``beta ≠ 0``, as TRL: no reference, no KL);
    - ``clip_ratio/low_mean``, ``clip_ratio/high_mean``, ``clip_ratio/region_mean``: the share of
      active tokens clipped (``"sequence"`` level: the share of the N sequences, empty ones
      included, as TRL's ``global_masked_mean`` of a ``(B, 1)`` tensor);
    - ``clip_ratio/low_min``, ``clip_ratio/high_max``: the least and greatest per-completion
      share (non-empty completions at the token level; NaN when there are none);
    - ``tokens`` (active tokens) and ``sequences`` (N): the denominators, so the means of several
      micro-batches combine exactly (TRL instead averages its micro-batches' means).
    """
    loss_NxT, parts = per_token_loss(
        settings, logps_NxT, old_logps_NxT, ref_logps_NxT, adv_N, mask_NxT
    )
    mask_NxT = (jnp.asarray(mask_NxT) > 0).astype(jnp.float32)
    loss = (jnp.asarray(weights_NxT, jnp.float32) * loss_NxT).sum()
    level = settings.importance_sampling_level
    metrics = {"tokens": mask_NxT.sum(), "sequences": jnp.float32(mask_NxT.shape[0])}
    if settings.beta != 0.0:
        metrics["kl"] = _masked_mean(parts["kl"], mask_NxT)
    low, low_N, low_counted_N = _clip_shares(parts["is_low_clipped"], mask_NxT, level)
    high, high_N, high_counted_N = _clip_shares(parts["is_high_clipped"], mask_NxT, level)
    metrics["clip_ratio/low_mean"] = low
    metrics["clip_ratio/high_mean"] = high
    metrics["clip_ratio/region_mean"] = _clip_shares(parts["is_region_clipped"], mask_NxT, level)[0]
    # NaN when no completion counts, as TRL's nanmin/nanmax of nothing but NaN
    least = jnp.min(jnp.where(low_counted_N, low_N, jnp.inf), initial=jnp.inf)
    most = jnp.max(jnp.where(high_counted_N, high_N, -jnp.inf), initial=-jnp.inf)
    metrics["clip_ratio/low_min"] = jnp.where(jnp.isinf(least), jnp.nan, least)
    metrics["clip_ratio/high_max"] = jnp.where(jnp.isinf(most), jnp.nan, most)
    return loss, metrics


def _expm1(x):
    """``expm1``, FP32-accurate on every backend: on a TPU at its highest accuracy (its default
    there is up to 1772 ULP in JAX's accuracy table; on a v5e k3 was 1.6e-6 off at d = −0.02,
    as exp(d) − 1 would be; the highest is 2 ULP), elsewhere JAX's own, whose value and
    gradient (expm1(d) + 1) are the CPU's as recorded: the highest-accuracy form differentiates
    through exp(d) instead, which moved the last bits of a two-device GRPO run's KL."""
    if jax.default_backend() == "tpu":
        return jax.lax.expm1(x, accuracy=HIGHEST)
    return jnp.expm1(x)
