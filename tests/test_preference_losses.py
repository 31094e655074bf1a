"""Preference losses against float64 NumPy written here from the papers' formulas: the loss and
its gradient with respect to the policy's log-probabilities, and the identities each loss
must satisfy (DPO is ln 2 at the reference, IPO's optimum margin, chosen/rejected swapped)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from minifield.strategies.preference import losses
from minifield.strategies.preference.losses import LossSettings

RNG = np.random.default_rng(23)
P = 7
# summed log-probabilities of answers of 1..12 tokens (each token's log-prob in [-3, -0.05])
LEN_C = RNG.integers(1, 13, P).astype(np.float64)
LEN_R = RNG.integers(1, 13, P).astype(np.float64)
CHOSEN = -LEN_C * RNG.uniform(0.05, 3.0, P)
REJECTED = -LEN_R * RNG.uniform(0.05, 3.0, P)
REF_C = CHOSEN + RNG.normal(0.0, 1.0, P)
REF_R = REJECTED + RNG.normal(0.0, 1.0, P)


def _sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


# -- the papers' formulas in float64: (per-pair loss, d loss / d chosen, d loss / d rejected) --


def dpo_ref(beta, eps):
    z = beta * ((CHOSEN - REF_C) - (REJECTED - REF_R))
    loss = -(1 - eps) * np.log(_sigmoid(z)) - eps * np.log(_sigmoid(-z))
    dz = _sigmoid(z) - (1 - eps)  # d loss / d z
    return loss, beta * dz, -beta * dz


def ipo_ref(beta):
    h = (CHOSEN - REF_C) - (REJECTED - REF_R)
    d = 2 * (h - 1 / (2 * beta))
    return (h - 1 / (2 * beta)) ** 2, d, -d


def simpo_ref(beta, gamma):
    z = beta * CHOSEN / LEN_C - beta * REJECTED / LEN_R - gamma
    dz = _sigmoid(z) - 1
    return -np.log(_sigmoid(z)), beta / LEN_C * dz, -beta / LEN_R * dz


def orpo_ref(lam):
    a, b = CHOSEN / LEN_C, REJECTED / LEN_R  # log P(y|x) per token, as the ORPO paper
    odds_a, odds_b = np.exp(a) / (1 - np.exp(a)), np.exp(b) / (1 - np.exp(b))
    ratio = np.log(odds_a / odds_b)
    loss = -a - lam * np.log(_sigmoid(ratio))
    d_ratio = lam * (_sigmoid(ratio) - 1)  # d loss / d ratio
    d_a = -1 + d_ratio / (1 - np.exp(a))  # d ratio / d a = 1 / (1 - e^a)
    d_b = -d_ratio / (1 - np.exp(b))
    return loss, d_a / LEN_C, d_b / LEN_R


def rpo_ref(reference, alpha):
    """RPO (Pang et al. 2024; TRL's rpo_alpha): the loss plus α times the chosen answer's NLL
    per token, −π_c/|y_c|, whose derivative in π_c is −α/|y_c| (none in π_r)."""
    loss, d_c, d_r = reference
    return loss - alpha * CHOSEN / LEN_C, d_c - alpha / LEN_C, d_r


def _case_id(value):
    if not isinstance(value, LossSettings):
        return ""
    return value.loss + ("+rpo" if value.rpo_alpha else "")


CASES = [
    (LossSettings("dpo", beta=0.1), dpo_ref(0.1, 0.0)),
    (LossSettings("dpo", beta=0.5, label_smoothing=0.2), dpo_ref(0.5, 0.2)),
    (LossSettings("ipo", beta=0.25), ipo_ref(0.25)),
    (LossSettings("simpo", beta=2.0, gamma=0.5), simpo_ref(2.0, 0.5)),
    (LossSettings("orpo", orpo_lambda=0.1), orpo_ref(0.1)),
    (LossSettings("orpo", orpo_lambda=1.5), orpo_ref(1.5)),
    (LossSettings("dpo", beta=0.1, rpo_alpha=1.0), rpo_ref(dpo_ref(0.1, 0.0), 1.0)),
    (
        LossSettings("dpo", beta=0.5, label_smoothing=0.2, rpo_alpha=0.3),
        rpo_ref(dpo_ref(0.5, 0.2), 0.3),
    ),
    (LossSettings("ipo", beta=0.25, rpo_alpha=2.0), rpo_ref(ipo_ref(0.25), 2.0)),
]


def _logps(chosen=CHOSEN, rejected=REJECTED, ref_c=REF_C, ref_r=REF_R, len_c=LEN_C, len_r=LEN_R):
    return {
        k: jnp.asarray(v, jnp.float32)
        for k, v in {
            "chosen": chosen,
            "rejected": rejected,
            "ref_chosen": ref_c,
            "ref_rejected": ref_r,
            "chosen_len": len_c,
            "rejected_len": len_r,
        }.items()
    }


@pytest.mark.parametrize(("settings", "reference"), CASES, ids=_case_id)
def test_loss_and_gradients_match_the_papers_formulas(settings, reference):
    want_loss, want_dc, want_dr = reference
    logps = _logps()
    per_pair = losses.pair_losses(settings, logps)[0]
    np.testing.assert_allclose(np.asarray(per_pair), want_loss, rtol=2e-5, atol=1e-6)

    def mean_loss(c, r):
        return losses.batch_loss(settings, {**logps, "chosen": c, "rejected": r}, jnp.ones(P))[0]

    d_c, d_r = jax.grad(mean_loss, argnums=(0, 1))(logps["chosen"], logps["rejected"])
    np.testing.assert_allclose(np.asarray(d_c), want_dc / P, rtol=2e-5, atol=1e-7)
    np.testing.assert_allclose(np.asarray(d_r), want_dr / P, rtol=2e-5, atol=1e-7)


@pytest.mark.parametrize("eps", [0.0, 0.3])
def test_dpo_is_ln2_when_the_policy_is_the_reference(eps):
    logps = _logps(ref_c=CHOSEN, ref_r=REJECTED)
    loss = losses.pair_losses(LossSettings("dpo", beta=0.7, label_smoothing=eps), logps)[0]
    np.testing.assert_allclose(np.asarray(loss), np.full(P, np.log(2.0)), rtol=1e-6)


def test_ipo_is_minimal_with_zero_gradient_at_margin_one_over_two_beta():
    beta = 0.2
    # the policy's chosen answer moved so the reward margin is exactly 1/(2β) = 2.5
    chosen = REF_C + (REJECTED - REF_R) + 1 / (2 * beta)
    settings = LossSettings("ipo", beta=beta)
    logps = _logps(chosen=chosen)
    np.testing.assert_allclose(np.asarray(losses.pair_losses(settings, logps)[0]), 0, atol=1e-5)
    grad = jax.grad(lambda c: losses.batch_loss(settings, {**logps, "chosen": c}, jnp.ones(P))[0])
    np.testing.assert_allclose(np.asarray(grad(logps["chosen"])), 0, atol=1e-5)
    for shift in (-0.5, 0.5):  # either side of the optimum the loss is larger
        moved = losses.pair_losses(settings, _logps(chosen=chosen + shift))[0]
        np.testing.assert_allclose(np.asarray(moved), shift**2, rtol=1e-4)


def test_the_rpo_term_leaves_the_rewards_and_counts_padding_pairs_out():
    """RPO adds to the loss only: the rewards are DPO's; a padding pair (length 0, valid 0)
    contributes nothing to the mean."""
    plain, rpo = LossSettings("dpo", beta=0.1), LossSettings("dpo", beta=0.1, rpo_alpha=1.0)
    rewards = losses.pair_losses(plain, _logps())[1:], losses.pair_losses(rpo, _logps())[1:]
    for a, b in zip(*rewards, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    valid = np.array([1, 1, 0, 1, 1, 1, 0], np.float32)
    padded = _logps(len_c=np.where(valid > 0, LEN_C, 0.0))
    loss = float(losses.batch_loss(rpo, padded, jnp.asarray(valid))[0])
    want = rpo_ref(dpo_ref(0.1, 0.0), 1.0)[0]
    np.testing.assert_allclose(loss, want[valid > 0].mean(), rtol=1e-6)


@pytest.mark.parametrize(("settings", "reference"), CASES[:4], ids=_case_id)
def test_swapping_chosen_and_rejected_mirrors_the_loss(settings, reference):
    """Swapped, the margin's sign flips: DPO/SimPO's loss becomes that of the negated margin
    (−log σ(−z) = −log σ(z) + z), IPO's that of −h; the rewards swap."""
    straight = losses.pair_losses(settings, _logps())
    swapped = losses.pair_losses(
        settings,
        _logps(
            chosen=REJECTED, rejected=CHOSEN, ref_c=REF_R, ref_r=REF_C, len_c=LEN_R, len_r=LEN_C
        ),
    )
    np.testing.assert_allclose(np.asarray(swapped[1]), np.asarray(straight[2]), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(swapped[2]), np.asarray(straight[1]), rtol=1e-6)
    margin = np.asarray(straight[1] - straight[2], np.float64)
    if settings.loss == "ipo":
        want = (-margin - 1 / (2 * settings.beta)) ** 2
    else:
        gamma = settings.gamma if settings.loss == "simpo" else 0.0
        eps = settings.label_smoothing
        z = -margin - gamma  # the swapped pair's
        want = -(1 - eps) * np.log(_sigmoid(z)) - eps * np.log(_sigmoid(-z))
    np.testing.assert_allclose(np.asarray(swapped[0]), want, rtol=2e-5)


def test_simpo_normalises_by_length_so_answers_of_different_lengths_compare_per_token():
    """Two answers with the same per-token log-prob (-0.5) but 2 and 10 tokens: SimPO sees no
    preference (margin 0, loss −log σ(−γ)), while the summed log-probs differ by 4 nats."""
    beta, gamma = 2.0, 0.5
    logps = _logps(
        chosen=np.full(P, -0.5 * 2),
        rejected=np.full(P, -0.5 * 10),
        len_c=np.full(P, 2.0),
        len_r=np.full(P, 10.0),
    )
    loss, reward_c, reward_r = losses.pair_losses(LossSettings("simpo", beta, gamma=gamma), logps)
    np.testing.assert_allclose(np.asarray(reward_c - reward_r), 0, atol=1e-6)
    np.testing.assert_allclose(np.asarray(loss), -np.log(_sigmoid(-gamma)), rtol=1e-6)
    # the same sums with lengths swapped: chosen is -1/token vs -0.5/token, margin β·(−0.5)
    swapped = _logps(
        chosen=np.full(P, -0.5 * 2),
        rejected=np.full(P, -0.5 * 10),
        len_c=np.full(P, 1.0),
        len_r=np.full(P, 20.0),
    )
    margin = losses.pair_losses(LossSettings("simpo", beta, gamma=gamma), swapped)
    np.testing.assert_allclose(np.asarray(margin[1] - margin[2]), beta * (-1.0 + 0.25), rtol=1e-6)


def test_batch_metrics_count_only_valid_pairs():
    """Padding pairs (valid 0) change neither the loss nor any metric."""
    settings = LossSettings("dpo", beta=0.1)
    valid = np.array([1, 1, 0, 1, 0, 1, 1], np.float32)
    loss, metrics = losses.batch_loss(settings, _logps(), jnp.asarray(valid))
    want_loss, _, _ = dpo_ref(0.1, 0.0)
    keep = valid > 0
    np.testing.assert_allclose(float(loss), want_loss[keep].mean(), rtol=1e-6)
    rc, rr = 0.1 * (CHOSEN - REF_C), 0.1 * (REJECTED - REF_R)
    assert float(metrics["pairs"]) == keep.sum()
    np.testing.assert_allclose(float(metrics["reward_accuracy"]), (rc > rr)[keep].mean())
    np.testing.assert_allclose(float(metrics["margin"]), (rc - rr)[keep].mean(), rtol=1e-5)
    np.testing.assert_allclose(float(metrics["chosen_logps"]), CHOSEN[keep].mean(), rtol=1e-6)
    np.testing.assert_allclose(float(metrics["rejected_logps"]), REJECTED[keep].mean(), rtol=1e-6)


def test_orpo_log_odds_stay_finite_near_probability_one():
    """An answer of log-prob −1e-7 per token (P ≈ 1): log(1 − e^a) is finite (log1mexp)."""
    a = jnp.asarray([-1e-7, -1e-3, -5.0, -40.0], jnp.float32)
    np.testing.assert_allclose(
        np.asarray(losses.log1mexp(a)),
        np.log(-np.expm1(np.asarray(a, np.float64))),
        rtol=1e-5,
        atol=1e-12,
    )
