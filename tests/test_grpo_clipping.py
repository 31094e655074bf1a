"""grpo's clipping past the first iteration against NumPy: an update of μ = 2 iterations on a
tiny Llama, whose second iteration's ratios are recomputed here in float64 from the parameters
after its first optimizer step (an update of μ = 1 from the same state: the same step) and the
update's iteration-1 log-probabilities. TRL's definitions (``_compute_loss``): the ratio
``r = exp(logps − old_logps)``, low-clipped where ``r < 1 − ε`` and ``A < 0``, high-clipped where
``r > 1 + ε_high`` and ``A > 0``, the shares over active tokens; the loss
``Σ w · −min(r·A, clip(r, 1 − ε, 1 + ε_high)·A)``. The update reports each share averaged over
its iterations (iteration 1's ratios are exactly 1: nothing clipped)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_grpo_accumulation import CFG, hand_made_batch

from minifield import schemas
from minifield.models import model
from minifield.rl import objective
from minifield.strategies.grpo import update as grpo_update
from minifield.strategies.grpo.rollouts_file import Batch
from minifield.training import optimizer, train_step

pytestmark = pytest.mark.slow  # two compiled updates and a forward of a model

EPS, EPS_HIGH, TEMPERATURE = 0.05, 0.1, 1.3


def _update(iterations: int):
    training = {**schemas.defaults(schemas.TRAINING), "learning_rate": 3e-2, "warmup_steps": 0}
    schedule = optimizer.make_schedule(training, 2)
    tx = optimizer.make_optimizer(training, 2, schedule)
    settings = objective.LossSettings(
        beta=0.0, epsilon=EPS, epsilon_high=EPS_HIGH, importance_sampling_level="token"
    )
    fn = grpo_update.make_update(CFG, tx, schedule, settings, iterations, TEMPERATURE)
    return jax.jit(fn), train_step.init_train_state(CFG, tx, seed=3)


def _logps_by_hand(params, tokens: np.ndarray) -> np.ndarray:
    """log softmax(logits / T) of slot t − 1 at token t, in float64 (slot 0: 0)."""
    n, s = tokens.shape
    segments = np.ones_like(tokens)
    positions = np.broadcast_to(np.arange(s, dtype=np.int32), tokens.shape)
    logits = np.asarray(model.forward(params, CFG, tokens, segments, positions), np.float64)
    logits /= TEMPERATURE
    shifted = logits - logits.max(-1, keepdims=True)
    log_softmax = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
    out = np.zeros((n, s))
    out[:, 1:] = np.take_along_axis(log_softmax[:, :-1], tokens[:, 1:, None], -1)[..., 0]
    return out


def test_the_second_iterations_clipping_is_numpys():
    batch = {k: v for k, v in hand_made_batch(0, "dapo", 1).items() if k != "ref_logps"}
    device_batch = Batch(**{k: jnp.asarray(v) for k, v in batch.items()})
    two, state = _update(2)
    one, _ = _update(1)
    _, metrics, old = two(state, device_batch)
    after_one, first, _ = one(state, device_batch)
    assert all(float(first[k]) == 0.0 for k in ("clip_low", "clip_high", "clip_region"))
    mask = batch["mask"] > 0
    adv = batch["advantages"].astype(np.float64)[:, None]
    ratio = np.exp(_logps_by_hand(after_one["params"], batch["tokens"]) - np.asarray(old))
    # no active ratio within rounding of a clip edge: the flags cannot depend on the precision
    for edge in (1 - EPS, 1 + EPS_HIGH):
        assert np.abs(ratio[mask] - edge).min() > 1e-4
    low = mask & (ratio < 1 - EPS) & (adv < 0)
    high = mask & (ratio > 1 + EPS_HIGH) & (adv > 0)
    assert low.sum() > 0 and high.sum() > 0  # both sides clip (and some tokens stay free)
    assert (low | high).sum() < mask.sum()
    tokens = mask.sum()
    assert float(metrics["clip_low"]) == pytest.approx(low.sum() / tokens / 2, abs=1e-7)
    assert float(metrics["clip_high"]) == pytest.approx(high.sum() / tokens / 2, abs=1e-7)
    assert float(metrics["clip_region"]) == pytest.approx((low | high).sum() / tokens / 2, abs=1e-7)
    clipped = np.clip(ratio, 1 - EPS, 1 + EPS_HIGH)
    surrogate = -np.minimum(ratio * adv, clipped * adv)
    loss = (batch["weights"].astype(np.float64) * np.where(mask, surrogate, 0.0)).sum()
    assert float(metrics["loss_final"]) == pytest.approx(loss, rel=1e-4)
