"""GRPO advantages, token weights and the policy objective against float64 NumPy written here
from TRL's documented definitions (``GRPOTrainer``: docs/source/grpo_trainer.md, ``_compute_loss``
and ``_generate_and_score_completions``), one completion at a time: the loss of each loss type
and ratio level, its gradient with respect to the policy's log-probabilities (analytic, and
checked by finite differences), the k3 KL, the clip metrics, and numbers worked out by hand.

The rollout: N = 6 completions of 2 prompts (G = 3), T = 5 positions, ragged masks (one with a
hole, as a tool mask makes, one empty), rewards of one prompt all 0."""

from __future__ import annotations

import ast
import math
from pathlib import Path
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from minifield.rl import advantages as adv_module
from minifield.rl.advantages import advantages, token_weights
from minifield.rl.objective import LossSettings, objective_value, per_token_loss
from minifield.strategies.grpo import rollouts_file

N, G, T, MAX_LEN = 6, 3, 5, 6
EPS, EPS_HIGH = 0.2, 0.28
MASK = np.array(
    [
        [1, 1, 1, 1, 1],
        [1, 1, 1, 0, 0],
        [1, 0, 0, 0, 0],
        [0, 0, 0, 0, 0],  # an empty completion
        [1, 0, 1, 1, 0],  # a hole, as a tool's tokens make
        [1, 1, 0, 0, 0],
    ],
    dtype=np.float32,
)
REWARDS = np.array([1.0, 0.0, 0.25, 0.0, 0.0, 0.0])
# Advantages of both signs on rows of every length (row 3 is empty, its 0 is never read).
ADV = np.array([0.9, -1.1, 0.4, 0.0, -0.7, 1.3], dtype=np.float32)
# log(new/old) per token, far from the clip edges (log 0.8 = −0.223, log 1.28 = 0.247). Token
# level: row 0 (A > 0) clipped high at t0, t2, t3; row 1 (A < 0) clipped low at t0, t2; row 4
# (A < 0, ratios > 1) and row 5 (A > 0, ratios < 1) move freely. Sequence level (GSPO, the mean
# log-ratio): row 0 0.3 (clipped high), row 1 −0.4 (clipped low), row 2 0.1, row 4 0.35 and
# row 5 −0.3 (unclipped for their advantage's sign).
LOG_RATIO = np.array(
    [
        [0.6, 0.0, 0.3, 0.5, 0.1],
        [-0.8, -0.1, -0.3, 0.0, 0.0],
        [0.1, 0.0, 0.0, 0.0, 0.0],
        [0.0, 0.0, 0.0, 0.0, 0.0],
        [0.5, 0.0, 0.2, 0.35, 0.0],
        [-0.5, -0.1, 0.0, 0.0, 0.0],
    ]
)
RNG = np.random.default_rng(7)
# float32 from the start: the reference reads exactly the numbers JAX reads
LOGPS = RNG.uniform(-3.0, -0.1, (N, T)).astype(np.float32)
OLD = (LOGPS - LOG_RATIO).astype(np.float32)
REF = (LOGPS + RNG.normal(0.0, 0.3, (N, T))).astype(np.float32)
LOSS_TYPES = ("grpo", "dapo", "dr_grpo", "bnpo")


class _Made(NamedTuple):
    """The rollouts' fields :func:`rollouts_file.batch_of` reads."""

    prompt_ids: list
    completion_ids: list
    truncated: list


def settings(beta=0.0, level="token"):
    return LossSettings(
        beta=beta, epsilon=EPS, epsilon_high=EPS_HIGH, importance_sampling_level=level
    )


# -- TRL's definitions in float64, one completion at a time ------------------------------------


def reference_advantages(rewards, g, scale):
    out = np.zeros(len(rewards))
    every = np.asarray(rewards, np.float64)
    for start in range(0, len(rewards), g):
        group = every[start : start + g]
        for j, r in enumerate(group):
            a = r - group.mean()
            if scale == "group":
                a /= np.std(group, ddof=1) + 1e-4  # torch's .std: Bessel-corrected
            elif scale == "batch":
                a /= np.std(every, ddof=1) + 1e-4
            out[start + j] = a
    return out


def row_coefficients(loss_type, mask, micro_batches=1):
    """c_i with loss = Σ_i c_i Σ_t l_it (docs/source/grpo_trainer.md "Loss Types", and TRL's
    bnpo: a token mean per micro-batch, then the mean over the accumulated micro-batches)."""
    n = len(mask)
    lens = [int(row.sum()) for row in mask]
    coef = []
    for i in range(n):
        if loss_type == "grpo":
            coef.append(1.0 / (max(lens[i], 1) * n))
        elif loss_type == "dapo":
            coef.append(1.0 / max(sum(lens), 1))
        elif loss_type == "dr_grpo":
            coef.append(1.0 / (n * MAX_LEN))
        else:  # micro-batch i mod M: every M-th row, as the update accumulates them
            coef.append(
                1.0 / (max(sum(lens[i % micro_batches :: micro_batches]), 1) * micro_batches)
            )
    return coef


def reference(loss_type, beta, level, logps, old, ref, adv, mask, micro_batches=1):
    """(loss, d loss / d logps): the surrogate per completion, its analytic gradient."""
    logps, old, ref = (np.asarray(x, np.float64) for x in (logps, old, ref))
    loss, grad = 0.0, np.zeros_like(logps)
    for i, c in enumerate(row_coefficients(loss_type, mask, micro_batches)):
        idx = np.flatnonzero(mask[i])
        if not len(idx):
            continue
        a = float(adv[i])
        log_ratio = logps[i, idx] - old[i, idx]
        if level == "sequence":  # GSPO: one ratio, the geometric mean of the token ratios
            ratio = np.full(len(idx), math.exp(log_ratio.mean()))
        else:
            ratio = np.exp(log_ratio)
        clipped = np.clip(ratio, 1 - EPS, 1 + EPS_HIGH)
        surrogate = -np.minimum(ratio * a, clipped * a)
        # the min takes the clipped (constant) term: no gradient through the ratio
        free = ratio * a <= clipped * a
        d = ref[i, idx] - logps[i, idx]
        kl = np.exp(d) - d - 1
        loss += c * (surrogate + beta * kl).sum()
        # Sequence level: the loss holds len_i copies of the sequence's surrogate, each with
        # d/d logps_it = −A·s/len_i, so the token's gradient is −A·s, the token level's form.
        d_ratio = np.where(free, -a * ratio, 0.0)
        grad[i, idx] = c * (d_ratio + beta * (1 - np.exp(d)))
    return loss, grad


# -- advantages ----------------------------------------------------------------------------------


def test_advantages_by_hand():
    """Rewards [1, 3, 5 | 4, 4, 4]: group 0 has mean 3 and (Bessel) std √((4+0+4)/2) = 2;
    group 1 is all equal (advantage 0 however scaled). The batch's std: mean 3.5, squared
    deviations 6.25 + .25 + 2.25 + 3·.25 = 9.5, over N − 1 = 5: √1.9 (√(9.5/6) would be ddof 0)."""
    rewards = np.array([1.0, 3.0, 5.0, 4.0, 4.0, 4.0])
    centred = np.array([-2.0, 0.0, 2.0, 0.0, 0.0, 0.0])
    np.testing.assert_array_equal(advantages(rewards, 3, "none"), centred)
    np.testing.assert_allclose(
        advantages(rewards, 3, "group"),
        [-0.999950002499875, 0.0, 0.999950002499875, 0.0, 0.0, 0.0],  # 2 / 2.0001
        rtol=1e-12,
    )
    np.testing.assert_allclose(
        advantages(rewards, 3, "batch"), centred / (math.sqrt(1.9) + 1e-4), rtol=1e-12
    )
    assert advantages(rewards, 3, "batch")[2] == pytest.approx(1.450847, abs=1e-6)


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_advantages_match_the_reference(scale):
    got = advantages(REWARDS, G, scale)
    assert got.dtype == np.float64
    np.testing.assert_allclose(got, reference_advantages(REWARDS, G, scale), rtol=1e-12)
    np.testing.assert_array_equal(got[3:], 0.0)  # the all-zero group


def test_an_unscored_completion_is_left_out_and_gets_zero():
    """TRL: NaN rewards are left out of nanmean/nanstd, the NaN advantage becomes 0."""
    got = advantages(np.array([1.0, np.nan, 3.0]), 3, "group")
    expect = 1.0 / (math.sqrt(2.0) + 1e-4)  # mean 2, std √((1 + 1) / 1)
    np.testing.assert_allclose(got, [-expect, 0.0, expect], rtol=1e-12)


def test_advantages_edges_and_errors():
    np.testing.assert_array_equal(advantages(np.array([1.0, 2.0]), 1, "group"), [0.0, 0.0])
    with pytest.raises(ValueError, match="scale_rewards"):
        advantages(REWARDS, G, "std")
    with pytest.raises(ValueError, match="num_generations"):
        advantages(REWARDS, 4, "group")
    for infinite in (np.inf, -np.inf):  # either sign: a −inf "never" reward is no advantage
        with pytest.raises(ValueError, match=r"infinite reward at rows \[1\]"):
            advantages(np.array([1.0, infinite, 0.0]), 3, "group")


# -- token weights -------------------------------------------------------------------------------

TINY = np.array([[1, 1, 0], [1, 0, 0], [0, 0, 0], [1, 1, 0]], dtype=np.float32)


def test_token_weights_by_hand():
    """4 completions of 2, 1, 0, 2 tokens, L = 4."""
    w = {t: token_weights(t, TINY, 4) for t in LOSS_TYPES}
    assert all(x.dtype == np.float32 for x in w.values())
    # grpo: 1 / (len_i · N)
    np.testing.assert_allclose(w["grpo"][:, 0], [1 / 8, 1 / 4, 0, 1 / 8], rtol=1e-7)
    # dapo: 1 / 5 tokens; dr_grpo: 1 / (N · L) = 1 / 16
    np.testing.assert_allclose(w["dapo"], TINY / 5, rtol=1e-7)
    np.testing.assert_allclose(w["dr_grpo"], TINY / 16, rtol=1e-7)
    np.testing.assert_allclose(w["bnpo"], w["dapo"], rtol=1e-7)  # one micro-batch
    # bnpo, 2 micro-batches of every other row: rows 0, 2 hold 2 tokens, rows 1, 3 hold 3;
    # the mean of the two token means
    bnpo2 = token_weights("bnpo", TINY, 4, micro_batches=2)
    np.testing.assert_allclose(bnpo2[0::2], TINY[0::2] / (2 * 2), rtol=1e-7)
    np.testing.assert_allclose(bnpo2[1::2], TINY[1::2] / (3 * 2), rtol=1e-7)
    for name, x in {**w, "bnpo2": bnpo2}.items():
        assert np.all(x[TINY == 0] == 0), name


def test_token_weight_sums():
    tokens = MASK.sum()
    sums = {t: float(token_weights(t, MASK, MAX_LEN).sum()) for t in LOSS_TYPES}
    assert sums["grpo"] == pytest.approx(5 / N, rel=1e-6)  # 5 non-empty rows of 6
    assert sums["dapo"] == pytest.approx(1.0, rel=1e-6)
    assert sums["dr_grpo"] == pytest.approx(tokens / (N * MAX_LEN), rel=1e-6)
    assert float(token_weights("bnpo", MASK, MAX_LEN, 3).sum()) == pytest.approx(1.0, rel=1e-6)
    # a micro-batch of empty completions only: weight 0, no division by 0
    empty_half = np.tile([[0.0] * 3, [1.0] * 3], (2, 1))  # rows 0, 2 (micro-batch 0) empty
    bnpo = token_weights("bnpo", empty_half, 3, micro_batches=2)
    assert np.isfinite(bnpo).all() and float(bnpo.sum()) == pytest.approx(0.5)


def test_token_weights_errors():
    with pytest.raises(ValueError, match="loss_type"):
        token_weights("ppo", MASK, MAX_LEN)
    with pytest.raises(ValueError, match="micro_batches"):
        token_weights("bnpo", MASK, MAX_LEN, micro_batches=4)
    with pytest.raises(ValueError, match="max_completion_length"):
        token_weights("dr_grpo", MASK, 4)


def test_dr_grpo_takes_a_completion_of_exactly_max_completion_length():
    """The longest completion MASK holds has 5 tokens: L = 5 is its limit, 4 is refused."""
    np.testing.assert_allclose(token_weights("dr_grpo", MASK, 5), MASK / (N * 5), rtol=1e-7)
    with pytest.raises(ValueError, match=r"longest completion \(5 tokens\), got 4"):
        token_weights("dr_grpo", MASK, 4)


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_an_update_without_active_tokens_has_zero_weights_and_loss(loss_type):
    """Every completion truncated under ``mask_truncated_completions: true``: the mask the
    strategy builds for them is all 0, so are the weights (TRL's ``clamp(min=1.0)``, never
    0/0), the loss and its gradient, at either ratio level; the clip shares of no tokens
    are 0, their per-completion extremes NaN (nothing to take them over)."""
    made = _Made([[1, 2], [3], [4, 5], [6]], [[7, 8, 9], [7, 8], [9, 9, 9], [8]], [True] * 4)
    rl = {"mask_truncated_completions": True, "loss_type": loss_type, "max_completion_length": 3}
    batch = rollouts_file.batch_of(made, np.array([1.0, -1.0, 0.5, -0.5]), rl, 8, 2)
    assert not batch.mask.any() and batch.ref_logps is None
    assert batch.weights.dtype == np.float32 and np.all(batch.weights == 0)
    logps = np.full((4, 8), -1.0, np.float32)
    for level in ("token", "sequence"):
        args = (logps, logps + 0.3, None, batch.advantages, batch.mask, batch.weights)
        value, grad = VALUE_AND_GRAD(settings(0.0, level), *args)
        assert float(value) == 0.0 and np.all(np.asarray(grad) == 0)
        _, metrics = objective_value(settings(0.0, level), *args)
        assert float(metrics["tokens"]) == 0.0
        assert float(metrics["clip_ratio/region_mean"]) == 0.0
    # without the option the same completions count
    kept = rollouts_file.batch_of(
        made, batch.advantages, {**rl, "mask_truncated_completions": False}, 8, 2
    )
    assert kept.mask.sum() == 9 and np.isfinite(kept.weights).all() and kept.weights.sum() > 0


def test_the_host_side_imports_no_jax():
    """The host side imports NumPy only (the strategy's host process need not load JAX)."""
    tree = ast.parse(Path(adv_module.__file__).read_text(encoding="utf-8"))
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert imported == {"__future__", "numpy"}


# -- the objective ----------------------------------------------------------------------------


def _loss(s, logps, old, ref, adv, mask, weights):
    return objective_value(s, logps, old, ref, adv, mask, weights)[0]


VALUE_AND_GRAD = jax.jit(jax.value_and_grad(_loss, argnums=1), static_argnums=0)


def tolerances() -> dict:
    """Against float64: FP32 rounding on CPU. On a TPU the loss and its gradient within the
    chip's default exp (the ratio's), up to 116 ULP in JAX's accuracy table for TPU v2-v5e
    against the CPU's 1.5 (measured on a v5e, JAX 0.10.2: the loss 2.1e-6 relative, the
    gradient 1.3e-5 relative and 1.2e-7 absolute; docs/tpu.md#tests-on-the-chip). k3 asks
    for expm1's highest accuracy (2 ULP there, the CPU's 6.5): FP32's bound on both."""
    k3 = {"rtol": 1e-5, "atol": 1e-8}
    if jax.default_backend() == "tpu":
        return {"loss": 1e-5, "grad": {"rtol": 5e-5, "atol": 3e-7}, "k3": k3}
    return {"loss": 1e-6, "grad": {"rtol": 1e-6, "atol": 1e-9}, "k3": k3}


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("beta", [0.0, 0.04])
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_loss_and_gradient_match_the_reference(loss_type, beta, level):
    """Off-policy (μ > 1: old ≠ new), clipped on both sides: the value and d/d logps, clipped
    tokens (beta 0) with zero gradient. bnpo with 2 micro-batches (1 is dapo's case)."""
    micro = 2 if loss_type == "bnpo" else 1
    weights = token_weights(loss_type, MASK, MAX_LEN, micro)
    ref = REF if beta else None
    value, grad = VALUE_AND_GRAD(settings(beta, level), LOGPS, OLD, ref, ADV, MASK, weights)
    expect, expect_grad = reference(loss_type, beta, level, LOGPS, OLD, REF, ADV, MASK, micro)
    assert value.dtype == grad.dtype == jnp.float32
    tol = tolerances()
    assert float(value) == pytest.approx(expect, rel=tol["loss"])
    np.testing.assert_allclose(np.asarray(grad), expect_grad, **tol["grad"])
    assert np.all(np.asarray(grad)[MASK == 0] == 0)
    if beta == 0.0:
        _, parts = per_token_loss(settings(0.0, level), LOGPS, OLD, None, ADV, MASK)
        clipped = np.asarray(parts["is_region_clipped"])
        assert clipped.sum() >= (2 if level == "sequence" else 5)  # both sides clip
        assert np.all(np.asarray(grad)[clipped] == 0)
        assert np.all(np.asarray(grad)[(MASK > 0) & ~clipped & (ADV[:, None] != 0)] != 0)


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_the_analytic_reference_gradient_is_the_finite_difference(level):
    """The reference's gradient, by central differences of the reference's loss (float64)."""
    base = LOGPS.astype(np.float64)
    _, analytic = reference("grpo", 0.04, level, base, OLD, REF, ADV, MASK)
    h = 1e-6
    for i, t in zip(*np.nonzero(MASK), strict=True):
        up, down = base.copy(), base.copy()
        up[i, t] += h
        down[i, t] -= h
        numeric = (
            reference("grpo", 0.04, level, up, OLD, REF, ADV, MASK)[0]
            - reference("grpo", 0.04, level, down, OLD, REF, ADV, MASK)[0]
        ) / (2 * h)
        assert numeric == pytest.approx(analytic[i, t], rel=1e-5, abs=1e-9)


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_on_policy_the_ratio_is_one(level):
    """First iteration (old = stop_gradient(logps), TRL's num_iterations == 1): no clipping,
    the grpo loss is −mean over completions of their advantage (an empty one adds 0), and
    each token's gradient is −A_i · its weight."""
    weights = token_weights("grpo", MASK, MAX_LEN)
    value, grad = VALUE_AND_GRAD(settings(0.0, level), LOGPS, None, None, ADV, MASK, weights)
    nonempty = MASK.sum(axis=1) > 0
    assert float(value) == pytest.approx(-ADV[nonempty].sum() / N, rel=1e-6)
    np.testing.assert_allclose(np.asarray(grad), -ADV[:, None] * weights, rtol=1e-6)
    explicit, _ = objective_value(settings(0.0, level), LOGPS, LOGPS, None, ADV, MASK, weights)
    assert float(explicit) == float(value)
    _, metrics = objective_value(settings(0.0, level), LOGPS, None, None, ADV, MASK, weights)
    assert float(metrics["clip_ratio/region_mean"]) == 0.0


def test_k3_kl():
    """k3 = exp(ref − logps) − (ref − logps) − 1: ≥ 0, 0 at the reference, the formula."""
    s = settings(0.04)
    _, parts = per_token_loss(s, LOGPS, None, REF, ADV, MASK)
    d = REF.astype(np.float64) - LOGPS
    np.testing.assert_allclose(
        np.asarray(parts["kl"]), (np.exp(d) - d - 1) * MASK, **tolerances()["k3"]
    )
    assert np.all(np.asarray(parts["kl"]) >= 0)
    _, at_ref = per_token_loss(s, LOGPS, None, LOGPS, ADV, MASK)
    assert np.all(np.asarray(at_ref["kl"]) == 0)
    _, none = per_token_loss(settings(0.0), LOGPS, None, None, ADV, MASK)
    assert np.all(np.asarray(none["kl"]) == 0)
    weights = token_weights("grpo", MASK, MAX_LEN)
    _, metrics = objective_value(s, LOGPS, OLD, REF, ADV, MASK, weights)
    expect = ((np.exp(d) - d - 1) * MASK).sum() / MASK.sum()
    assert float(metrics["kl"]) == pytest.approx(expect, rel=1e-5)
    assert "kl" not in objective_value(settings(0.0), LOGPS, OLD, None, ADV, MASK, weights)[1]


def test_clip_metrics_by_hand():
    """14 active tokens. Token level: high-clipped row 0 t0, t2, t3 (3/14), low-clipped row 1
    t0, t2 (2/14); per completion the least low share is 0, the greatest high share 3/5.
    Sequence level: row 0 high, row 1 low, of 6 sequences (the empty one counted)."""
    weights = token_weights("dapo", MASK, MAX_LEN)
    jitted = jax.jit(objective_value, static_argnums=0)  # the metrics compile too
    _, tok = jitted(settings(0.0, "token"), LOGPS, OLD, None, ADV, MASK, weights)
    assert float(tok["clip_ratio/high_mean"]) == pytest.approx(3 / 14)
    assert float(tok["clip_ratio/low_mean"]) == pytest.approx(2 / 14)
    assert float(tok["clip_ratio/region_mean"]) == pytest.approx(5 / 14)
    assert float(tok["clip_ratio/low_min"]) == 0.0
    assert float(tok["clip_ratio/high_max"]) == pytest.approx(3 / 5)
    assert float(tok["tokens"]) == 14 and float(tok["sequences"]) == 6
    # a zero advantage is never clipped (its surrogate is 0 either way), however far its ratio
    zero = ADV.copy()
    zero[1] = 0.0
    _, flat = jitted(settings(0.0, "token"), LOGPS, OLD, None, zero, MASK, weights)
    assert float(flat["clip_ratio/low_mean"]) == 0.0
    _, seq = objective_value(settings(0.0, "sequence"), LOGPS, OLD, None, ADV, MASK, weights)
    assert float(seq["clip_ratio/high_mean"]) == pytest.approx(1 / 6)
    assert float(seq["clip_ratio/low_mean"]) == pytest.approx(1 / 6)
    assert float(seq["clip_ratio/region_mean"]) == pytest.approx(2 / 6)
    assert float(seq["clip_ratio/low_min"]) == 0.0
    assert float(seq["clip_ratio/high_max"]) == 1.0


def test_ratios_between_one_plus_epsilon_and_one_plus_epsilon_high_are_not_clipped():
    """DAPO's clip-higher (TRL: ``coef_1 > 1 + epsilon_high``): with ε = 0.2 and ε_high = 0.28
    a ratio of 1.25 and A > 0 is unclipped (surrogate −1.25·A, gradient −1.25·A·w), 1.3 is
    clipped (−1.28·A, no gradient); with A < 0, 0.85 is free and 0.75 clipped low (−0.8·A).
    Hand values: token shares high 1/4, low 1/4, region 2/4."""
    ratios = np.array([[1.25, 1.3], [0.85, 0.75]])
    adv = np.array([2.0, -1.0], np.float32)
    mask = np.ones((2, 2), np.float32)
    weights = token_weights("dapo", mask, 2)  # 1/4 each
    old = np.full((2, 2), -1.0, np.float32)
    logps = (old + np.log(ratios)).astype(np.float32)
    value, grad = VALUE_AND_GRAD(settings(0.0), logps, old, None, adv, mask, weights)
    expect = (-1.25 * 2.0 - 1.28 * 2.0 + 0.85 * 1.0 + 0.8 * 1.0) / 4
    assert float(value) == pytest.approx(expect, rel=1e-6)
    np.testing.assert_allclose(
        np.asarray(grad), [[-1.25 * 2.0 / 4, 0.0], [0.85 / 4, 0.0]], rtol=1e-5, atol=1e-9
    )
    _, metrics = objective_value(settings(0.0), logps, old, None, adv, mask, weights)
    assert float(metrics["clip_ratio/high_mean"]) == pytest.approx(1 / 4)
    assert float(metrics["clip_ratio/low_mean"]) == pytest.approx(1 / 4)
    assert float(metrics["clip_ratio/region_mean"]) == pytest.approx(2 / 4)
    assert float(metrics["clip_ratio/high_max"]) == pytest.approx(1 / 2)


def test_low_min_leaves_empty_completions_out():
    """Every non-empty completion has half its tokens clipped low; an empty one (share 0/0,
    TRL's NaN, left out by its nanmin) must not make the least share 0."""
    mask = np.array([[1, 1], [1, 1], [0, 0]], np.float32)
    old = np.full((3, 2), -1.0, np.float32)
    logps = (old + np.log([[0.5, 1.0], [1.0, 0.5], [1.0, 1.0]])).astype(np.float32)
    adv = np.array([-1.0, -1.0, -1.0], np.float32)
    weights = token_weights("grpo", mask, 2)
    _, metrics = objective_value(settings(0.0), logps, old, None, adv, mask, weights)
    assert float(metrics["clip_ratio/low_min"]) == 0.5
    assert float(metrics["clip_ratio/low_mean"]) == pytest.approx(2 / 4)


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_micro_batches_add_up_to_the_update(loss_type):
    """Σ over micro-batches of Σ w · loss is the whole update's loss: accumulation is exact."""
    s = settings(0.04, "token")
    weights = token_weights(loss_type, MASK, MAX_LEN, micro_batches=2)
    whole, _ = objective_value(s, LOGPS, OLD, REF, ADV, MASK, weights)
    halves = [
        objective_value(s, LOGPS[r], OLD[r], REF[r], ADV[r], MASK[r], weights[r])[0]
        for r in (slice(0, None, 2), slice(1, None, 2))  # the update's split: every other row
    ]
    assert float(sum(halves)) == pytest.approx(float(whole), rel=1e-6)


def test_padding_values_are_never_read():
    """Whatever padding holds (−inf, huge), the loss and its gradient are those of the clean
    rollout: no NaN from exp or 0 · inf."""
    dirty = np.where(MASK > 0, LOGPS, -np.inf).astype(np.float32)
    dirty_old = np.where(MASK > 0, OLD, 1e30).astype(np.float32)
    weights = token_weights("dapo", MASK, MAX_LEN)
    for level in ("token", "sequence"):
        s = settings(0.04, level)
        clean = VALUE_AND_GRAD(s, LOGPS, OLD, REF, ADV, MASK, weights)
        value, grad = VALUE_AND_GRAD(s, dirty, dirty_old, REF, ADV, MASK, weights)
        assert float(value) == float(clean[0])
        np.testing.assert_array_equal(np.asarray(grad), np.asarray(clean[1]))


def test_unknown_ratio_level_is_refused():
    with pytest.raises(ValueError, match="importance_sampling_level"):
        per_token_loss(settings(0.0, "sentence"), LOGPS, OLD, None, ADV, MASK)
