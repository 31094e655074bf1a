"""AdamW with linear warmup, a decay schedule and global-norm gradient clipping (optax).

Keys read from a recipe's ``training`` section (others are ignored); an absent key takes its
default from the JSON Schema (``strategy-training.schema.json``, the one place the defaults
live, :func:`defaults`):

=========================== =========================================================
key                         meaning
=========================== =========================================================
learning_rate               peak learning rate
warmup_steps                updates of linear warmup (0: none)
decay                       ``cosine`` | ``linear`` | ``constant`` after warmup
min_learning_rate_ratio     final learning rate as a fraction of the peak
weight_decay                decoupled weight decay (matrices only, see below)
b1                          Adam first-moment decay
b2                          Adam second-moment decay
eps                         Adam epsilon
grad_clip_norm              clip the global gradient norm to this (0: no clipping)
=========================== =========================================================

Schedule, with ``s`` the number of updates already applied (0 for the first update),
``W`` the warmup steps, ``S`` = ``max_steps``, peak ``P`` and floor ``m = P * ratio``:

- warmup, ``s < W``: ``P * (s + 1) / W`` (the first update already moves);
- then, with ``progress = clip((s - W) / (S - W), 0, 1)``:
  cosine ``m + (P - m) * (1 + cos(pi * progress)) / 2``, linear
  ``P + (m - P) * progress``, constant ``P``.

Weight decay applies to parameters with two or more dimensions (weight matrices and
embedding tables), not to biases or LayerNorm parameters; a leaf holding layers stacked along
its first axis (:func:`minifield.models.layers.layer_stack.stack_layers`, the scanned update) is judged by the rank
of one layer's leaf, so every element decays as it would in the per-layer layout. The optimizer state's moment
estimates have the parameters' dtype (FP32); its step counters are int32 scalars.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import optax

from .. import schemas
from ..models.layers import layer_stack

#: the training keys the optimizer reads (the module docstring's table)
KEYS = (
    "learning_rate",
    "warmup_steps",
    "decay",
    "min_learning_rate_ratio",
    "weight_decay",
    "b1",
    "b2",
    "eps",
    "grad_clip_norm",
)
DECAYS = ("cosine", "linear", "constant")


def defaults() -> dict:
    """``{key: default}`` of :data:`KEYS`, as the recipe schema gives them."""
    shared = schemas.defaults(schemas.TRAINING)
    return {key: shared[key] for key in KEYS}


def _settings(training: dict, max_steps: int) -> dict:
    s = {**defaults(), **{key: training[key] for key in KEYS if key in training}}
    errors = []
    if isinstance(max_steps, bool) or not isinstance(max_steps, int) or max_steps < 1:
        errors.append(f"limits.max_steps: expected a positive integer, got {max_steps!r}")
    if not (isinstance(s["learning_rate"], int | float) and s["learning_rate"] > 0):
        errors.append(f"training.learning_rate: expected a number > 0, got {s['learning_rate']!r}")
    warm = s["warmup_steps"]
    if isinstance(warm, bool) or not isinstance(warm, int) or warm < 0:
        errors.append(f"training.warmup_steps: expected an integer >= 0, got {warm!r}")
    if s["decay"] not in DECAYS:
        errors.append(f"training.decay: expected one of {DECAYS}, got {s['decay']!r}")
    ratio = s["min_learning_rate_ratio"]
    if not (isinstance(ratio, int | float) and 0 <= ratio <= 1):
        errors.append(
            f"training.min_learning_rate_ratio: expected a number in [0, 1], got {ratio!r}"
        )
    for key, low, high in (("b1", 0, 1), ("b2", 0, 1)):
        v = s[key]
        if not (isinstance(v, int | float) and low <= v < high):
            errors.append(f"training.{key}: expected a number in [{low}, {high}), got {v!r}")
    for key in ("weight_decay", "grad_clip_norm"):
        v = s[key]
        if not (isinstance(v, int | float) and v >= 0 and math.isfinite(v)):
            errors.append(f"training.{key}: expected a finite number >= 0, got {v!r}")
    if not (isinstance(s["eps"], int | float) and s["eps"] > 0):
        errors.append(f"training.eps: expected a number > 0, got {s['eps']!r}")
    if errors:
        raise ValueError("; ".join(errors))
    return s


def make_schedule(training: dict, max_steps: int):
    """The learning-rate schedule ``s -> lr`` (a jittable function of the update count)."""
    s = _settings(training, max_steps)
    peak = float(s["learning_rate"])
    floor = peak * float(s["min_learning_rate_ratio"])
    warmup = int(s["warmup_steps"])
    decay_steps = max(max_steps - warmup, 1)
    decay = s["decay"]

    def schedule(count):
        step = jnp.asarray(count, jnp.float32)
        warm = peak * (step + 1.0) / max(warmup, 1)
        progress = jnp.clip((step - warmup) / decay_steps, 0.0, 1.0)
        if decay == "cosine":
            after = floor + (peak - floor) * 0.5 * (1.0 + jnp.cos(jnp.pi * progress))
        elif decay == "linear":
            after = peak + (floor - peak) * progress
        else:
            after = jnp.full_like(progress, peak)
        return jnp.where(step < warmup, warm, after)

    return schedule


def _decay_mask(params):
    def decays(path, leaf):
        rank = leaf.ndim - 1 if layer_stack.is_stacked_leaf(path) else leaf.ndim
        return rank >= 2

    return jax.tree_util.tree_map_with_path(decays, params)


def make_optimizer(training: dict, max_steps: int, schedule=None) -> optax.GradientTransformation:
    """``optax.chain(clip_by_global_norm, adamw(schedule))`` per the module docstring.

    ``schedule``: :func:`make_schedule`'s for the same ``training`` and ``max_steps``, when
    the caller needs it too (the update reports its learning rate); built here otherwise."""
    s = _settings(training, max_steps)
    if schedule is None:
        schedule = make_schedule(training, max_steps)
    parts = []
    if s["grad_clip_norm"] > 0:
        parts.append(optax.clip_by_global_norm(float(s["grad_clip_norm"])))
    parts.append(
        optax.adamw(
            schedule,
            b1=float(s["b1"]),
            b2=float(s["b2"]),
            eps=float(s["eps"]),
            weight_decay=float(s["weight_decay"]),
            mask=_decay_mask,
        )
    )
    return optax.chain(*parts)
