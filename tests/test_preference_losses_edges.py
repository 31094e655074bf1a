"""Preference batch metrics at their edges, against values worked out by hand: ties of the
rewards (every pair at step 0 of DPO/IPO, where the policy is its reference), batches of one
valid pair and of none, and the recipe section as the loss reads it. Every batch has four
pairs (padding pairs where fewer are meant), so the eager operations compile once."""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
import pytest

from minifield.strategies.preference import losses
from minifield.strategies.preference import section as section_rules
from minifield.strategies.preference.losses import LossSettings


def _logps(chosen, rejected, ref_chosen, ref_rejected, chosen_len=None, rejected_len=None):
    n = len(chosen)
    values = {
        "chosen": chosen,
        "rejected": rejected,
        "ref_chosen": ref_chosen,
        "ref_rejected": ref_rejected,
        "chosen_len": chosen_len if chosen_len is not None else [4.0] * n,
        "rejected_len": rejected_len if rejected_len is not None else [4.0] * n,
    }
    return {k: jnp.asarray(v, jnp.float32) for k, v in values.items()}


@pytest.mark.parametrize("loss", ["dpo", "ipo"])
def test_at_the_reference_no_pair_is_ordered_correctly(loss):
    """At step 0 the policy is its reference: every reward is 0, so no pair's chosen reward
    is above its rejected one. Reward accuracy is 0 (a tie is not a correct order, or the
    DEV accuracy gate would pass before any training), the margin 0."""
    chosen, rejected = [-3.0, -7.5, -1.25, -2.0], [-4.0, -2.0, -6.5, -2.0]
    logps = _logps(chosen, rejected, chosen, rejected)
    _, metrics = losses.batch_loss(LossSettings(loss, beta=0.5), logps, jnp.ones(4))
    assert float(metrics["reward_accuracy"]) == 0.0
    assert float(metrics["margin"]) == 0.0


def test_reward_accuracy_counts_strictly_larger_chosen_rewards_only():
    """DPO, β = 1 (rewards are the log-ratios): pair 0 ordered (1 > −1), pair 1 tied (0.5 and
    0.5), pair 2 reversed (−1 < 0), pair 3 ordered (2 > 0): 2 of 4 correct."""
    policy_c, ref_c = [-1.0, -2.5, -4.0, -1.0], [-2.0, -3.0, -3.0, -3.0]
    policy_r, ref_r = [-5.0, -1.5, -2.0, -6.0], [-4.0, -2.0, -2.0, -6.0]
    _, metrics = losses.batch_loss(
        LossSettings("dpo", beta=1.0), _logps(policy_c, policy_r, ref_c, ref_r), jnp.ones(4)
    )
    assert float(metrics["reward_accuracy"]) == 0.5
    # margins 2, 0, −1, 2: mean 0.75
    assert float(metrics["margin"]) == pytest.approx(0.75, abs=1e-6)


@pytest.mark.parametrize("valid", [[1.0, 0.0, 0.0, 0.0], [0.0, 0.0, 1.0, 0.0]])
def test_a_batch_of_one_valid_pair_is_that_pair(valid):
    """One valid pair: the batch loss and every metric are the pair's own, divided by 1.
    DPO, β = 0.5: rewards 0.5 · (−2 + 3) = 0.5 and 0.5 · (−4 + 3) = −0.5, z = 1, loss
    −log σ(1) = log(1 + e^−1)."""
    n = len(valid)
    where = valid.index(1.0)
    chosen = [-9.0] * n
    rejected = [-1.0] * n
    chosen[where], rejected[where] = -2.0, -4.0
    logps = _logps(chosen, rejected, [-3.0] * n, [-3.0] * n)
    loss, metrics = losses.batch_loss(LossSettings("dpo", beta=0.5), logps, jnp.asarray(valid))
    assert float(loss) == pytest.approx(math.log1p(math.exp(-1.0)), rel=1e-6)
    assert float(metrics["pairs"]) == 1.0
    assert float(metrics["loss_sum"]) == pytest.approx(math.log1p(math.exp(-1.0)), rel=1e-6)
    assert float(metrics["reward_accuracy"]) == 1.0
    assert float(metrics["margin"]) == pytest.approx(1.0, rel=1e-6)
    assert float(metrics["chosen_logps"]) == -2.0
    assert float(metrics["rejected_logps"]) == -4.0


def test_a_batch_without_valid_pairs_is_zero_not_nan():
    """Only padding pairs (an evaluation batch's filler): nothing to average, everything 0."""
    chosen, rejected, ref = [-2.0, -3.0, -1.0, -5.0], [-4.0, -1.0, -2.0, -1.0], [-3.0] * 4
    logps = _logps(chosen, rejected, ref, ref, [0.0] * 4, [0.0] * 4)
    loss, metrics = losses.batch_loss(LossSettings("dpo", beta=0.5), logps, jnp.zeros(4))
    assert float(loss) == 0.0
    assert {k: float(v) for k, v in metrics.items()} == {
        "pairs": 0.0,
        "loss_sum": 0.0,
        "reward_accuracy": 0.0,
        "margin": 0.0,
        "chosen_logps": 0.0,
        "rejected_logps": 0.0,
    }


def test_the_settings_read_the_section_and_default_to_the_schemas_absent_values():
    """A key absent from the section means the schema's ``x-absent`` (β 0.1, no smoothing,
    γ 0.5, λ 0.1, no RPO term), the same whether the section filled it in or not; keys of
    the section that are not the loss's are not read."""
    absent = section_rules.absent_values("preference")
    for loss in ("dpo", "ipo", "simpo", "orpo"):
        assert LossSettings.of({"loss": loss}) == LossSettings.of({"loss": loss, **absent})
    section = {
        "loss": "dpo",
        "beta": 0.3,
        "label_smoothing": 0.1,
        "gamma": 1.5,
        "orpo_lambda": 0.2,
        "rpo_alpha": 0.7,
        "reference": "frozen",
    }
    assert LossSettings.of(section) == LossSettings("dpo", 0.3, 0.1, 1.5, 0.2, 0.7)
    assert LossSettings("dpo").uses_reference and LossSettings("ipo").uses_reference
    assert not LossSettings("simpo").uses_reference and not LossSettings("orpo").uses_reference
    with pytest.raises(ValueError, match="preference.loss must be one of"):
        losses.pair_losses(LossSettings("kto"), _logps(*[[-1.0] * 4] * 4))


def test_dpo_without_label_smoothing_is_the_plain_loss():
    """``dpo``'s smoothing defaults to none: z = 0.5 · ((−2 + 3) − (−4 + 3)) = 1, loss
    −log σ(1)."""
    c, r, ref = (jnp.full(4, v, jnp.float32) for v in (-2.0, -4.0, -3.0))
    loss, _, _ = losses.dpo(c, r, ref, ref, 0.5)
    np.testing.assert_allclose(np.asarray(loss), math.log1p(math.exp(-1.0)), rtol=1e-6)
