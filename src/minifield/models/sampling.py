"""How generation chooses each next token: greedy (argmax) or sampled, and where it stops.

Sampling applies transformers' logit warpers in transformers' order: divide the logits by
``temperature``, keep the ``top_k`` largest, then keep the nucleus, the fewest most probable
of those whose probabilities (the softmax of what is left) sum to at least ``top_p``; the
token is drawn from the softmax of the kept logits. Each cut is a threshold on the logit, so
tokens tied with the last one kept are kept too. ``top_k`` 0 and ``top_p`` 1 switch their cut
off. The draw for row ``b`` at step ``i`` uses ``fold_in(fold_in(key(seed), i), b)``: the same
seed gives the same tokens, and a row's tokens do not depend on the other rows of its batch.

The settings (:func:`resolve`): the caller's values win, then ``generation_config.json``'s
(``do_sample``, ``temperature``, ``top_k``, ``top_p``), then transformers' defaults (1.0, 50,
1.0). Generation is greedy unless the file says ``do_sample: true`` or the caller gives a
sampling value; ``temperature`` 0 is greedy whatever else is set.
"""

from __future__ import annotations

import math
import numbers
from typing import NamedTuple

#: transformers' ``GenerationConfig`` defaults, used where neither the caller nor the file says
DEFAULT_TEMPERATURE, DEFAULT_TOP_K, DEFAULT_TOP_P = 1.0, 50, 1.0
#: the largest seed (``jax.random.key`` takes a 32-bit one everywhere)
MAX_SEED = 2**32 - 1


class Sampling(NamedTuple):
    """Sampling settings; a pytree, so one compiled loop serves every value."""

    temperature: float
    top_k: int
    top_p: float


class GenerationDefaults(NamedTuple):
    """What a model's ``generation_config.json`` says about choosing tokens (None: silent)."""

    do_sample: bool = False
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None


def _check(name: str, value, where: str):
    """``value`` for ``name`` if it is valid, else ``ValueError`` naming ``where`` and ``name``."""
    if name == "do_sample":
        ok, expected = type(value) is bool, "true or false"
    elif name == "top_k":
        ok, expected = type(value) is int and value >= 0, "a whole number >= 0"
    else:
        is_number = type(value) in (int, float) and math.isfinite(value)
        if name == "temperature":
            ok, expected = is_number and value >= 0, "a number >= 0"
        else:  # top_p
            ok, expected = is_number and 0 < value <= 1, "a number > 0 and <= 1"
    if not ok:
        raise ValueError(f"{where}{name} must be {expected}, got {value!r}")
    return value


def defaults_from(generation_config: dict, where: str) -> GenerationDefaults:
    """The sampling fields of a ``generation_config.json`` object (``where`` names it);
    absent or null fields are silent, a field of the wrong type or range is refused."""
    values = {}
    for name in GenerationDefaults._fields:
        value = generation_config.get(name)
        if value is not None:
            values[name] = _check(name, value, f"{where}: ")
    return GenerationDefaults(**values)


def resolve(
    defaults: GenerationDefaults,
    temperature: float | None = None,
    top_k: int | None = None,
    top_p: float | None = None,
) -> Sampling | None:
    """The settings one generation uses (see the module): None for greedy."""
    given = {"temperature": temperature, "top_k": top_k, "top_p": top_p}
    for name, value in given.items():
        if value is not None:
            _check(name, value, "")
    if temperature == 0:
        return None
    if not defaults.do_sample and all(value is None for value in given.values()):
        return None
    chosen = Sampling(
        temperature=_first(temperature, defaults.temperature, DEFAULT_TEMPERATURE),
        top_k=_first(top_k, defaults.top_k, DEFAULT_TOP_K),
        top_p=_first(top_p, defaults.top_p, DEFAULT_TOP_P),
    )
    return None if chosen.temperature == 0 else chosen


def _first(*values):
    return next(value for value in values if value is not None)


def stop_ids(*sources) -> tuple[int, ...]:
    """Every id the given ``eos_token_id`` values name (each an int, a list of ints or None),
    sorted: generation stops on any of them."""
    ids = set()
    for value in sources:
        if isinstance(value, numbers.Integral):
            ids.add(int(value))
        elif value is not None:
            ids.update(int(v) for v in value)
    return tuple(sorted(ids))


# ----------------------------------------------------------------------------- in the loop


def filter_logits(logits_BxV, sampling: Sampling):
    """The logits sampling draws from: divided by the temperature, ``-inf`` outside the top
    ``k`` and outside the nucleus (``[B, V]`` FP32)."""
    import jax
    import jax.numpy as jnp

    scaled_BxV = logits_BxV.astype(jnp.float32) / sampling.temperature
    V = scaled_BxV.shape[-1]
    sorted_BxV = -jnp.sort(-scaled_BxV, axis=-1)  # descending
    k = jnp.where(sampling.top_k > 0, jnp.minimum(sampling.top_k, V), V)
    in_top_k_V = jnp.arange(V) < k
    probs_BxV = jax.nn.softmax(jnp.where(in_top_k_V, sorted_BxV, -jnp.inf), axis=-1)
    # a token is in the nucleus when the more probable ones sum to less than top_p; top_p 1
    # is no nucleus (a float32 cumulative sum reaches 1 before the least probable tokens)
    before_BxV = jnp.cumsum(probs_BxV, axis=-1) - probs_BxV
    in_nucleus_BxV = (before_BxV < sampling.top_p) | (sampling.top_p >= 1.0)
    kept_BxV = in_top_k_V & (in_nucleus_BxV | (jnp.arange(V) == 0))
    threshold_Bx1 = jnp.min(jnp.where(kept_BxV, sorted_BxV, jnp.inf), axis=-1, keepdims=True)
    return jnp.where(scaled_BxV >= threshold_Bx1, scaled_BxV, -jnp.inf)


def sampled_logits(logits_BxV, sampling: Sampling):
    """:func:`filter_logits`, without its sort over the vocabulary when neither top-k nor the
    nucleus cuts anything (``top_k`` 0 or at least V and ``top_p`` 1: a grpo recipe's
    defaults) and no logit is NaN: then the filter keeps every logit (each is at or above the
    least one), so the scaled logits are its result, the same bits. A NaN logit (a diverged
    policy) takes the sort, whose threshold it makes order-dependent."""
    import jax
    import jax.numpy as jnp

    V = logits_BxV.shape[-1]
    cuts = ((sampling.top_k > 0) & (sampling.top_k < V)) | (sampling.top_p < 1.0)
    cuts = cuts | jnp.isnan(logits_BxV).any()
    return jax.lax.cond(cuts, filter_logits, _scaled, logits_BxV, sampling)


def _scaled(logits_BxV, sampling: Sampling):
    import jax.numpy as jnp

    return logits_BxV.astype(jnp.float32) / sampling.temperature


def draw(logits_BxV, sampling: Sampling, keys_B):
    """Row ``b``'s token drawn with ``keys_B[b]`` from the softmax of :func:`sampled_logits`."""
    import jax
    import jax.numpy as jnp

    filtered_BxV = sampled_logits(logits_BxV, sampling)
    return jax.vmap(jax.random.categorical)(keys_B, filtered_BxV).astype(jnp.int32)


# The token choices a decode loop takes (:func:`minifield.models.model.decode`): called as
# ``choice(logits_BxV, step)`` for the next token of each row ``[B]`` int32. Each is a
# pytree (its settings and keys traced), so one compiled loop serves every value.


class Greedy(NamedTuple):
    """The argmax of each row (the lowest id among ties)."""

    def __call__(self, logits_BxV, step):
        import jax.numpy as jnp

        return jnp.argmax(logits_BxV, axis=-1).astype(jnp.int32)


class SeededDraw(NamedTuple):
    """A draw (:func:`draw`) with row ``b``'s key at step ``i``
    ``fold_in(fold_in(key(seed), i), b)`` (see the module)."""

    sampling: Sampling
    seed: object  # a uint32 scalar

    def __call__(self, logits_BxV, step):
        import jax
        import jax.numpy as jnp

        step_key = jax.random.fold_in(jax.random.key(self.seed), step)
        keys_B = jax.vmap(lambda row: jax.random.fold_in(step_key, row))(
            jnp.arange(logits_BxV.shape[0])
        )
        return draw(logits_BxV, self.sampling, keys_B)


class KeyedDraw(NamedTuple):
    """A draw (:func:`draw`) with row ``b``'s key at step ``i`` ``fold_in(keys_B[b], i)``:
    a row's tokens depend on its own key alone, not on its place in the batch."""

    sampling: Sampling
    keys_B: object  # [B] typed keys

    def __call__(self, logits_BxV, step):
        import jax

        step_keys_B = jax.vmap(lambda key: jax.random.fold_in(key, step))(self.keys_B)
        return draw(logits_BxV, self.sampling, step_keys_B)


def choice(sampling: Sampling | None, seed) -> Greedy | SeededDraw:
    """Greedy when ``sampling`` is None, else a draw from ``seed`` (see the module)."""
    return Greedy() if sampling is None else SeededDraw(sampling, seed)


def is_stop(tokens_B, stops_S):
    """Whether each token is one of the stop ids (``-1`` entries stop nothing)."""
    return (tokens_B[:, None] == stops_S[None, :]).any(axis=-1)
