"""AdamW schedule, clipping and weight-decay mask, checked against hand-computed numbers."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from minifield import recipe as recipes
from minifield.training.optimizer import make_optimizer, make_schedule

PEAK, FLOOR = 1e-2, 1e-3
BASE = {"learning_rate": PEAK, "warmup_steps": 4, "min_learning_rate_ratio": 0.1}


@pytest.mark.parametrize(
    ("decay", "expected"),
    [
        # s: 0..3 warmup (s+1)/4 of the peak; 4 starts the decay over 14 - 4 = 10 updates.
        # s = 6 is 20 % into the decay: cos(0.2 pi) = 0.80901699.
        (
            "cosine",
            {
                0: 0.0025,
                1: 0.005,
                3: 0.01,
                4: 0.01,
                6: 0.001 + 0.009 * 0.5 * (1 + 0.80901699),
                9: 0.0055,
                14: 0.001,
                40: 0.001,
            },
        ),
        ("linear", {0: 0.0025, 3: 0.01, 4: 0.01, 6: 0.0082, 9: 0.0055, 14: 0.001, 40: 0.001}),
        ("constant", {0: 0.0025, 3: 0.01, 4: 0.01, 9: 0.01, 40: 0.01}),
    ],
)
def test_schedule_values(decay, expected):
    schedule = make_schedule({**BASE, "decay": decay}, max_steps=14)
    for step, value in expected.items():
        assert float(schedule(step)) == pytest.approx(value, rel=1e-5), (decay, step)


def test_no_warmup_starts_at_the_peak():
    schedule = make_schedule({"learning_rate": 0.5, "warmup_steps": 0, "decay": "linear"}, 10)
    assert float(schedule(0)) == pytest.approx(0.5)
    assert float(schedule(5)) == pytest.approx(0.5 + (0.05 - 0.5) * 0.5)


def test_first_adam_update_moves_each_weight_by_the_scheduled_rate():
    # After one step Adam's bias-corrected m/sqrt(v) is g/|g| (up to eps), so each
    # weight moves by exactly the learning rate of update 0: 0.0025 here.
    tx = make_optimizer({**BASE, "weight_decay": 0.0, "eps": 1e-12}, max_steps=14)
    params = {"w": jnp.array([[1.0, -2.0], [0.5, 3.0]]), "b": jnp.array([0.1, 0.2])}
    grads = {"w": jnp.array([[0.3, -0.1], [2.0, -0.4]]), "b": jnp.array([-0.2, 0.05])}
    updates, _ = tx.update(grads, tx.init(params), params)
    for name in params:
        np.testing.assert_allclose(updates[name], -0.0025 * np.sign(grads[name]), rtol=1e-5)


def _first_update_norm(grad_norm, clip):
    """Norm of the first update with Adam made linear in g (b1 = b2 = 0, huge eps).

    update = -lr * g_clipped / (|g_clipped| + eps) ~= -lr * g_clipped / eps, so
    |update| * eps / lr recovers |g_clipped|.
    """
    eps, lr = 1e6, 1.0
    tx = make_optimizer(
        {
            "learning_rate": lr,
            "warmup_steps": 0,
            "decay": "constant",
            "weight_decay": 0.0,
            "b1": 0.0,
            "b2": 0.0,
            "eps": eps,
            "grad_clip_norm": clip,
        },
        max_steps=5,
    )
    direction = {"a": jnp.array([3.0, 4.0]), "b": jnp.array([[0.0, 12.0]])}  # norm 13
    grads = jax.tree_util.tree_map(lambda g: g * (grad_norm / 13.0), direction)
    params = jax.tree_util.tree_map(jnp.zeros_like, grads)
    updates, _ = tx.update(grads, tx.init(params), params)
    return float(optax.tree.norm(updates)) * eps / lr


def test_clipping_bounds_the_global_norm():
    assert _first_update_norm(10.0, clip=1.0) == pytest.approx(1.0, rel=1e-4)
    assert _first_update_norm(0.5, clip=1.0) == pytest.approx(0.5, rel=1e-4)
    assert _first_update_norm(10.0, clip=0.0) == pytest.approx(10.0, rel=1e-4)  # 0: off


def test_weight_decay_applies_to_matrices_only():
    tx = make_optimizer(
        {"learning_rate": 0.1, "warmup_steps": 0, "decay": "constant", "weight_decay": 0.5},
        max_steps=3,
    )
    params = {"w": jnp.full((2, 2), 2.0), "b": jnp.full((2,), 2.0)}
    zero = jax.tree_util.tree_map(jnp.zeros_like, params)
    updates, _ = tx.update(zero, tx.init(params), params)
    np.testing.assert_allclose(updates["w"], -0.1 * 0.5 * 2.0)  # -lr * wd * w
    np.testing.assert_array_equal(updates["b"], 0.0)


def test_optimizer_state_is_fp32_with_int32_counters():
    tx = make_optimizer({}, max_steps=10)
    params = {"w": jnp.ones((3, 2), jnp.float32), "b": jnp.ones((2,), jnp.float32)}
    leaves = jax.tree_util.tree_leaves(tx.init(params))
    assert {leaf.dtype for leaf in leaves} == {jnp.dtype("float32"), jnp.dtype("int32")}
    assert all(leaf.shape == () for leaf in leaves if leaf.dtype == jnp.int32)


def test_defaults_are_the_recipe_schemas():
    """An absent key means what a recipe without it trains with: the schema's default."""
    schedule = make_schedule({}, max_steps=120)  # 3e-3 peak, 20 warmup, cosine to 3e-4
    assert float(schedule(0)) == pytest.approx(3e-3 / 20)
    assert float(schedule(19)) == pytest.approx(3e-3)
    assert float(schedule(70)) == pytest.approx(3e-4 + 2.7e-3 * 0.5 * (1 + math.cos(math.pi / 2)))
    # the same numbers as a validated recipe that leaves its training section empty
    recipe = recipes.validate(
        {
            "job_id": "defaults",
            "product": {"name": "p", "version": "1"},
            "strategy": {"name": "packed-sft", "version": "12.0.0"},
            "inputs": [
                {"name": s, "path": f"{s}.jsonl", "sha256": "0" * 64}
                for s in ("train", "dev", "test")
            ],
            "limits": {"max_steps": 120},
        }
    )
    filled = make_schedule(recipe.data["training"], 120)
    assert [float(filled(s)) for s in (0, 19, 70, 119)] == [
        float(schedule(s)) for s in (0, 19, 70, 119)
    ]
    assert recipe.data["training"]["learning_rate"] == 0.003
    assert recipe.data["training"]["warmup_steps"] == 20


def test_bad_settings_are_named():
    with pytest.raises(ValueError, match="training.decay"):
        make_optimizer({"decay": "exponential"}, 10)
    with pytest.raises(ValueError, match="training.learning_rate"):
        make_optimizer({"learning_rate": -1}, 10)
    with pytest.raises(ValueError, match="limits.max_steps"):
        make_optimizer({}, 0)
    with pytest.raises(ValueError, match=r"training.b2.*\[0, 1\)"):
        make_optimizer({"b2": 1.0}, 10)
