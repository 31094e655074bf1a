"""Rotary ``rope_scaling`` of the Llama family: reading it from ``config.json`` and the scaled
inverse frequencies, computed here and nowhere else.

The types and their keys are transformers' (``modeling_rope_utils``, 4.x), computed as it does:

- ``linear`` (``factor``): every inverse frequency divided by ``factor`` (the same as
  dividing the positions);
- ``llama3`` (``factor``, ``low_freq_factor``, ``high_freq_factor``,
  ``original_max_position_embeddings``): wavelengths shorter than
  ``original / high_freq_factor`` unchanged, longer than ``original / low_freq_factor``
  divided by ``factor``, those between interpolated by
  ``s = (original / wavelength - low) / (high - low)``: ``(1 - s) f / factor + s f``;
- ``dynamic`` (``factor``, optionally ``original_max_position_embeddings``, which transformers
  reads but does not use): NTK base scaling by the length seen so far, which transformers only
  applies to a sequence longer than ``max_position_embeddings``; below it the frequencies are
  the plain ones. It is accepted only when the run's rows (``seq_len``) fit within
  ``max_position_embeddings``, where it is exactly the plain rotary; beyond, transformers'
  result depends on the history of lengths a module has seen, which training cannot
  reproduce, so it is refused.

- ``longrope`` (Phi-3/3.5: ``short_factor``, ``long_factor``, one per frequency; optionally
  ``factor``, ``attention_factor``, ``original_max_position_embeddings``): every inverse
  frequency divided by its short factor, and cos/sin multiplied by ``attention_factor``
  (absent: ``sqrt(1 + ln(factor) / ln(original))``, 1 for ``factor <= 1``; ``factor`` is
  ``max_position_embeddings / original_max_position_embeddings`` when config.json has the
  latter at top level). transformers switches to the long factors for a batch whose largest
  position reaches past ``original``, which would make a packed example depend on its row
  neighbours; it is accepted only when the run's rows fit within ``original`` (the short
  factors throughout), else refused.

``rope_type`` (or the legacy ``type``) ``default`` is the plain rotary; ``yarn`` or any other
type, and any key a type does not use, are refused naming the field.
:class:`~.llama.LlamaConfig` holds the scaling as sorted ``(key, value)`` pairs (hashable).
"""

from __future__ import annotations

import math

#: rope_type -> (required keys, optional keys), besides ``rope_type``/``type``
TYPES = {
    "default": (set(), set()),
    "linear": ({"factor"}, set()),
    "llama3": (
        {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"},
        set(),
    ),
    "dynamic": ({"factor"}, {"original_max_position_embeddings"}),
    "longrope": (
        {"short_factor", "long_factor"},
        {"factor", "attention_factor", "original_max_position_embeddings"},
    ),
}
#: keys whose value is one number per frequency
_PER_FREQUENCY = ("short_factor", "long_factor")


def read(
    scaling, refuse, max_len: int, max_positions: int | None, original=None, half=None
) -> tuple:
    """``config.json``'s ``rope_scaling`` object as the sorted pairs a config holds (empty
    for none or ``default``). ``refuse(reason)`` raises naming the file; ``max_len``: the
    longest row the model will see; ``max_positions``: ``max_position_embeddings``;
    ``original``: a top-level ``original_max_position_embeddings`` (Phi-3); ``half``: the
    number of rotary frequencies (head_dim / 2)."""
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind not in TYPES:
        refuse(f"rope_scaling.rope_type {kind!r} is not supported (expected one of {list(TYPES)})")
    required, optional = TYPES[kind]
    keys = set(scaling) - {"rope_type", "type"}
    unknown = sorted(keys - required - optional)
    if unknown:
        refuse(f"rope_scaling.{unknown[0]} is not supported for rope_type {kind!r}")
    missing = sorted(required - keys)
    if missing:
        refuse(f"rope_scaling.{missing[0]} missing (rope_type {kind!r} needs it)")
    values = {}
    for key in sorted(keys & set(_PER_FREQUENCY)):
        value = scaling[key]
        numbers = type(value) is list and all(type(v) in (int, float) and v > 0 for v in value)
        if not numbers or len(value) != half:
            refuse(f"rope_scaling.{key} must be {half} positive numbers (head_dim / 2)")
        values[key] = tuple(float(v) for v in value)
    for key in sorted(keys - set(_PER_FREQUENCY)):
        value = scaling[key]
        integer = key == "original_max_position_embeddings"
        fits = type(value) is int if integer else type(value) in (int, float)
        if not fits or not value > 0:
            words = "a positive integer" if integer else "a positive number"
            refuse(f"rope_scaling.{key} must be {words}, found {value!r}")
        values[key] = value if integer else float(value)
    if kind == "llama3" and not values["high_freq_factor"] > values["low_freq_factor"]:
        refuse("rope_scaling.high_freq_factor must exceed rope_scaling.low_freq_factor")
    if kind == "dynamic" and (max_positions is None or max_len > max_positions):
        refuse(
            f"rope_scaling.rope_type 'dynamic' with rows of {max_len} positions beyond "
            f"max_position_embeddings {max_positions} is not supported (transformers rescales "
            "by the lengths it has seen; training cannot reproduce that)"
        )
    if kind == "longrope":
        values = _longrope(values, refuse, max_len, max_positions, original)
    return () if kind == "default" else tuple(sorted({**values, "rope_type": kind}.items()))


def _longrope(values: dict, refuse, max_len: int, max_positions, original) -> dict:
    """The pairs of a ``longrope`` scaling with its ``attention_factor`` worked out (as
    transformers' ``_compute_longrope_parameters``)."""
    if original is not None:
        factor = (max_positions or original) / original
    else:
        original = values.get("original_max_position_embeddings", max_positions)
        factor = values.get("factor", 1.0)
    if original is None or max_len > original:
        refuse(
            f"rope_scaling.rope_type 'longrope' with rows of {max_len} positions beyond "
            f"original_max_position_embeddings {original} is not supported (transformers "
            "switches to long_factor by the longest position in a batch; packed rows cannot)"
        )
    if "attention_factor" not in values:
        scale = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original))
        values["attention_factor"] = scale
    return {**values, "original_max_position_embeddings": original}


def inv_freq(theta: float, half: int, scaling: tuple = ()):
    """FP32 inverse frequencies ``[half]`` of a head of ``2 * half`` channels."""
    import jax.numpy as jnp  # reading a config (:func:`read`) must not import JAX

    plain_K2 = theta ** (-jnp.arange(half, dtype=jnp.float32) / half)
    params = dict(scaling)
    kind = params.pop("rope_type", "default")
    if kind in ("default", "dynamic"):  # dynamic: rows within max_position_embeddings (read)
        return plain_K2
    if kind == "longrope":  # rows within original_max_position_embeddings (read): short
        return plain_K2 / jnp.asarray(params["short_factor"], jnp.float32)
    factor = params["factor"]
    if kind == "linear":
        return plain_K2 / factor
    original = params["original_max_position_embeddings"]
    low, high = params["low_freq_factor"], params["high_freq_factor"]
    wavelen_K2 = 2 * math.pi / plain_K2
    long_K2 = jnp.where(wavelen_K2 > original / low, plain_K2 / factor, plain_K2)
    smooth_K2 = (original / wavelen_K2 - low) / (high - low)
    smoothed_K2 = (1 - smooth_K2) * long_K2 / factor + smooth_K2 * long_K2
    medium_K2 = (wavelen_K2 >= original / high) & (wavelen_K2 <= original / low)
    return jnp.where(medium_K2, smoothed_K2, long_K2)


def amplitude(scaling: tuple) -> float:
    """The factor cos and sin are multiplied by (``longrope``'s ``attention_factor``)."""
    return dict(scaling).get("attention_factor", 1.0)


def to_hf(scaling: tuple) -> dict | None:
    """``config.json``'s ``rope_scaling`` for a config's pairs (None for the plain rotary)."""
    return {k: list(v) if k in _PER_FREQUENCY else v for k, v in scaling} or None


def from_dict(scaling: dict) -> tuple:
    """A config's pairs from their ``to_dict`` form (JSON lists back to tuples)."""
    return tuple(sorted((k, tuple(v) if k in _PER_FREQUENCY else v) for k, v in scaling.items()))
