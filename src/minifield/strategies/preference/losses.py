"""Preference losses: pure JAX functions of per-answer log-probabilities.

Every loss reads, per pair ``i``, the policy's summed log-probability of the chosen and the
rejected answer (``chosen``, ``rejected``: sums over the answer's tokens only, end-of-turn
token included), the answers' token counts (``chosen_len``, ``rejected_len``) and, for the
losses that have one, the reference model's summed log-probabilities (``ref_chosen``,
``ref_rejected``). Each returns the per-pair loss and the per-pair implicit rewards of the
chosen and rejected answer; :func:`batch_loss` averages over the valid pairs of a batch.

- **DPO** (Rafailov et al. 2023), with conservative label smoothing ε (cDPO):
  ``z = β((π_c − r_c) − (π_r − r_r))``, ``loss = −(1 − ε) log σ(z) − ε log σ(−z)``;
  rewards ``β(π − r)``.
- **IPO** (Azar et al. 2023), on summed log-probabilities as the paper writes it:
  ``h = (π_c − r_c) − (π_r − r_r)``, ``loss = (h − 1/(2β))²``; rewards ``π − r``.
- **SimPO** (Meng et al. 2024), reference-free and length-normalised:
  ``z = β π_c/|y_c| − β π_r/|y_r| − γ``, ``loss = −log σ(z)``; rewards ``β π/|y|``.
- **ORPO** (Hong et al. 2024), reference-free, on the length-normalised log-probabilities
  ``a = π/|y|`` (the paper's ``P(y|x)`` is their exponential): ``loss = −a_c + λ · −log σ(
  log odds(a_c) − log odds(a_r))`` with ``log odds(a) = a − log(1 − e^a)``; rewards ``a``.
- **RPO** term (Pang et al. 2024, TRL's ``rpo_alpha``), DPO and IPO only: ``rpo_alpha`` α > 0
  adds ``α · (−π_c/|y_c|)``, the chosen answer's NLL per token, to the pair's loss, so the
  preference term cannot lower the chosen answer's likelihood unchecked (docs/preference.md
  "The demo"). Per pair (TRL averages over the batch's chosen tokens), so a pair's loss does
  not depend on its batch and DEV loss adds up over evaluation batches. The rewards are the
  loss's own (the term changes no reward).

Rewards order the pair: a pair's reward accuracy is ``reward_c > reward_r``, its margin
``reward_c − reward_r``.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

from .section import LOSSES, WITH_REFERENCE

__all__ = ["LOSSES", "WITH_REFERENCE", "LossSettings", "batch_loss", "pair_losses"]


@dataclass(frozen=True)
class LossSettings:
    """The recipe's ``preference`` section as the loss reads it."""

    loss: str
    beta: float = 0.1
    label_smoothing: float = 0.0
    gamma: float = 0.5
    orpo_lambda: float = 0.1
    #: the RPO term's weight (0: none, the plain loss)
    rpo_alpha: float = 0.0

    @classmethod
    def of(cls, section: dict) -> LossSettings:
        keys = ("loss", "beta", "label_smoothing", "gamma", "orpo_lambda", "rpo_alpha")
        return cls(**{k: section[k] for k in keys if k in section})

    @property
    def uses_reference(self) -> bool:
        return self.loss in WITH_REFERENCE


def dpo(chosen, rejected, ref_chosen, ref_rejected, beta: float, label_smoothing: float = 0.0):
    """Per-pair DPO loss and the rewards ``β(π − r)`` of chosen and rejected."""
    reward_c, reward_r = beta * (chosen - ref_chosen), beta * (rejected - ref_rejected)
    z = reward_c - reward_r
    loss = -(1.0 - label_smoothing) * jax.nn.log_sigmoid(z) - label_smoothing * jax.nn.log_sigmoid(
        -z
    )
    return loss, reward_c, reward_r


def ipo(chosen, rejected, ref_chosen, ref_rejected, beta: float):
    """Per-pair IPO loss and the rewards ``π − r`` (minimum where their margin is 1/(2β))."""
    reward_c, reward_r = chosen - ref_chosen, rejected - ref_rejected
    return (reward_c - reward_r - 1.0 / (2.0 * beta)) ** 2, reward_c, reward_r


def simpo(chosen, rejected, chosen_len, rejected_len, beta: float, gamma: float):
    """Per-pair SimPO loss and the rewards ``β π/|y|``."""
    reward_c, reward_r = beta * chosen / chosen_len, beta * rejected / rejected_len
    return -jax.nn.log_sigmoid(reward_c - reward_r - gamma), reward_c, reward_r


def log1mexp(x):
    """``log(1 − e^x)`` for ``x < 0``, accurate near 0 and far below it (Mächler 2012)."""
    return jnp.where(x > -jnp.log(2.0), jnp.log(-jnp.expm1(x)), jnp.log1p(-jnp.exp(x)))


def orpo(chosen, rejected, chosen_len, rejected_len, orpo_lambda: float):
    """Per-pair ORPO loss (chosen NLL per token + λ · odds-ratio term) and the rewards
    (length-normalised log-probabilities)."""
    a_c, a_r = chosen / chosen_len, rejected / rejected_len
    log_odds = (a_c - log1mexp(a_c)) - (a_r - log1mexp(a_r))
    return -a_c - orpo_lambda * jax.nn.log_sigmoid(log_odds), a_c, a_r


def pair_losses(settings: LossSettings, logps: dict):
    """``(loss, reward_chosen, reward_rejected)`` per pair for the recipe's loss.

    ``logps`` holds ``chosen``, ``rejected``, ``chosen_len``, ``rejected_len`` and, for
    DPO/IPO, ``ref_chosen``, ``ref_rejected`` (arrays of one shape).
    """
    c, r = logps["chosen"], logps["rejected"]
    # a padding pair has length 0: divide by 1 instead (its loss is weighted out)
    n_c, n_r = jnp.maximum(logps["chosen_len"], 1), jnp.maximum(logps["rejected_len"], 1)
    if settings.loss in ("dpo", "ipo"):
        if settings.loss == "dpo":
            loss, reward_c, reward_r = dpo(
                c,
                r,
                logps["ref_chosen"],
                logps["ref_rejected"],
                settings.beta,
                settings.label_smoothing,
            )
        else:
            loss, reward_c, reward_r = ipo(
                c, r, logps["ref_chosen"], logps["ref_rejected"], settings.beta
            )
        if settings.rpo_alpha:  # 0: the plain loss, not a zero added to it
            loss = loss + settings.rpo_alpha * (-c / n_c)
        return loss, reward_c, reward_r
    if settings.loss == "simpo":
        return simpo(c, r, n_c, n_r, settings.beta, settings.gamma)
    if settings.loss == "orpo":
        return orpo(c, r, n_c, n_r, settings.orpo_lambda)
    raise ValueError(f"preference.loss must be one of {LOSSES}, got {settings.loss!r}")


def batch_loss(settings: LossSettings, logps: dict, valid):
    """Mean loss over the valid pairs (``valid`` 1/0 per pair) and the batch's metrics:
    ``pairs``, ``loss_sum``, ``reward_accuracy``, ``margin`` (mean reward margin),
    ``chosen_logps`` and ``rejected_logps`` (mean summed log-probabilities)."""
    valid = valid.astype(jnp.float32)
    loss, reward_c, reward_r = pair_losses(settings, logps)
    pairs = jnp.sum(valid)
    per = 1.0 / jnp.maximum(pairs, 1.0)
    loss_sum = jnp.sum(jnp.where(valid > 0, loss, 0.0))

    def mean(x):
        return jnp.sum(jnp.where(valid > 0, x, 0.0)) * per

    metrics = {
        "pairs": pairs,
        "loss_sum": loss_sum,
        "reward_accuracy": mean((reward_c > reward_r).astype(jnp.float32)),
        "margin": mean(reward_c - reward_r),
        "chosen_logps": mean(logps["chosen"]),
        "rejected_logps": mean(logps["rejected"]),
    }
    return loss_sum * per, metrics
