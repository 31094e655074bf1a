"""The sampling rules (:mod:`minifield.models.sampling`) where ``tests/test_load_model.py``
leaves them open: which of caller, ``generation_config.json`` and transformers' defaults wins
for each setting, ``temperature`` 0 from the file, the values refused, the largest seed, the
top-k cut when the nucleus is switched off, and one key per row.

Expected values are written out here (transformers' ``GenerationConfig`` defaults: temperature
1.0, top_k 50, top_p 1.0), computed with NumPy (the ``k`` largest logits of each row) or drawn
with ``jax.random`` from the keys the module's docstring names.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from minifield.hf.loaded_model import LoadedModel
from minifield.models import sampling as sampling_rules
from minifield.models.sampling import GenerationDefaults, Sampling

#: a file that says everything (Llama 3 instruct's values, plus a top_k)
FILE = GenerationDefaults(do_sample=True, temperature=0.6, top_k=20, top_p=0.9)


# -- resolve: who wins --------------------------------------------------------------------------


def test_each_caller_value_wins_over_the_files_alone():
    assert sampling_rules.resolve(FILE, temperature=1.3) == Sampling(1.3, 20, 0.9)
    assert sampling_rules.resolve(FILE, top_k=5) == Sampling(0.6, 5, 0.9)
    assert sampling_rules.resolve(FILE, top_p=0.5) == Sampling(0.6, 20, 0.5)
    assert sampling_rules.resolve(FILE, 1.3, 5, 0.5) == Sampling(1.3, 5, 0.5)
    # a caller's 0 top_k (no cut) is a value, not an absence
    assert sampling_rules.resolve(FILE, top_k=0) == Sampling(0.6, 0, 0.9)


def test_the_file_wins_over_transformers_defaults_which_fill_the_rest():
    assert sampling_rules.resolve(FILE) == Sampling(0.6, 20, 0.9)
    assert sampling_rules.resolve(GenerationDefaults(do_sample=True)) == Sampling(1.0, 50, 1.0)
    assert sampling_rules.resolve(GenerationDefaults(), temperature=0.8) == Sampling(0.8, 50, 1.0)
    assert sampling_rules.resolve(GenerationDefaults(), top_k=3) == Sampling(1.0, 3, 1.0)


def test_temperature_zero_in_the_file_is_greedy():
    """``do_sample: true`` with ``temperature: 0`` is greedy, also when the caller gives a
    top-k or top-p but no temperature; a caller's temperature overrides the file's 0."""
    zero = GenerationDefaults(do_sample=True, temperature=0.0)
    assert sampling_rules.resolve(zero) is None
    assert sampling_rules.resolve(zero, top_k=5) is None
    assert sampling_rules.resolve(zero, top_p=0.5) is None
    assert sampling_rules.resolve(zero, temperature=0.7) == Sampling(0.7, 50, 1.0)
    file = sampling_rules.defaults_from({"do_sample": True, "temperature": 0}, "g.json")
    assert sampling_rules.resolve(file) is None


# -- the values refused -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "value", "expected"),
    [
        ("top_p", 0, "a number > 0 and <= 1"),
        ("top_p", 0.0, "a number > 0 and <= 1"),
        ("top_p", -0.5, "a number > 0 and <= 1"),
        ("top_p", 1.0000001, "a number > 0 and <= 1"),
        ("top_p", True, "a number > 0 and <= 1"),
        ("top_p", math.nan, "a number > 0 and <= 1"),
        ("temperature", math.inf, "a number >= 0"),
        ("temperature", math.nan, "a number >= 0"),
        ("temperature", True, "a number >= 0"),
        ("temperature", -0.1, "a number >= 0"),
        ("temperature", "1", "a number >= 0"),
        ("top_k", True, "a whole number >= 0"),
        ("top_k", 2.0, "a whole number >= 0"),
        ("top_k", -1, "a whole number >= 0"),
        ("do_sample", 1, "true or false"),
        ("do_sample", 0, "true or false"),
        ("do_sample", "true", "true or false"),
    ],
)
def test_a_bad_value_is_refused_from_the_file_and_from_the_caller(name, value, expected):
    message = f"{name} must be {expected}, got {value!r}"
    with pytest.raises(ValueError) as raised:
        sampling_rules.defaults_from({name: value}, "g.json")
    assert str(raised.value) == f"g.json: {message}"
    if name != "do_sample":  # the caller has no do_sample
        with pytest.raises(ValueError) as raised:
            sampling_rules.resolve(GenerationDefaults(), **{name: value})
        assert str(raised.value) == message


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("top_p", 1),
        ("top_p", 1.0),
        ("top_p", 1e-9),
        ("temperature", 0),
        ("temperature", 1e6),
        ("top_k", 0),
        ("do_sample", False),
    ],
)
def test_the_edges_of_each_range_are_accepted(name, value):
    assert getattr(sampling_rules.defaults_from({name: value}, "g.json"), name) == value
    if name != "do_sample":
        sampling_rules.resolve(GenerationDefaults(), **{name: value})


def test_the_largest_seed_is_the_largest_32_bit_one(monkeypatch):
    """``jax.random.key`` takes a 32-bit seed: 2**32 - 1 is generated with (and draws), 2**32
    and -1 are refused before anything runs."""
    largest = int(np.iinfo(np.uint32).max)
    assert sampling_rules.MAX_SEED == largest
    seen = []

    def fake_generate_batch(params, cfg, prompts, budget, stops, sampling=None, seed=0):
        seen.append(seed)
        return [[1]]

    from minifield.models import model

    monkeypatch.setattr(model, "generate_batch", fake_generate_batch)
    loaded = LoadedModel(
        SimpleNamespace(max_len=16), None, None, None, GenerationDefaults(), (), "m"
    )
    assert loaded.generate_ids([0], 2, seed=largest) == [1] and seen == [largest]
    for bad in (largest + 1, -1):
        with pytest.raises(ValueError, match=rf"^seed must be a whole number 0\.\.{largest}, "):
            loaded.generate_ids([0], 2, seed=bad)
    assert seen == [largest]
    from minifield.cli import build_parser

    args = build_parser().parse_args(["generate", "--model", "m", "--seed", str(largest)])
    assert args.seed == largest
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "--model", "m", "--seed", str(largest + 1)])


# -- in the loop --------------------------------------------------------------------------------


#: random logits spread widely (normal, sd 6): many rows hold tokens whose probability a float32
#: cumulative sum cannot tell apart from the rest, and top-k sums that end just under 1
LOGITS = np.random.default_rng(7).normal(0.0, 6.0, (2000, 64)).astype(np.float32)
#: jitted once for the module (the sampling values are traced, not compiled in)
FILTER = jax.jit(sampling_rules.filter_logits)


def test_top_k_cuts_when_the_nucleus_is_off():
    """``top_p`` 1 switches the nucleus off, so exactly the ``k`` largest logits of each row
    stay (NumPy's argsort). The FP32 sum of the kept probabilities falls just under 1 for
    many random rows; counted here, so the premise is checked too."""
    k = 5
    filtered = np.asarray(FILTER(LOGITS, Sampling(1.0, k, 1.0)))
    kept = np.isfinite(filtered)
    top = np.zeros_like(kept)
    np.put_along_axis(top, np.argsort(-LOGITS, axis=1)[:, :k], True, axis=1)
    np.testing.assert_array_equal(kept, top)
    np.testing.assert_array_equal(filtered[kept], LOGITS[kept])
    # the premise: FP32 cumulative sums of the top-k probabilities end below 1 in some rows
    top_logits = -np.sort(-LOGITS, axis=1)[:, :k]
    probs = np.asarray(jax.nn.softmax(jnp.asarray(top_logits), axis=-1))
    assert (np.cumsum(probs, axis=1, dtype=np.float32)[:, -1] < 1.0).sum() > 100


@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_top_p_one_and_top_k_zero_cut_nothing(temperature):
    """Both cuts off (transformers adds no top-k warper at 0 and no top-p warper at 1): every
    token stays, also those below about 6e-8 that come after a float32 cumulative sum has
    reached 1 (the premise, in float64: such tokens exist in most rows)."""
    filtered = np.asarray(FILTER(LOGITS, Sampling(temperature, 0, 1.0)))
    np.testing.assert_array_equal(filtered, LOGITS / np.float32(temperature))
    scaled = LOGITS.astype(np.float64) / temperature
    p = np.exp(scaled - scaled.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    assert ((p < 6e-8).any(axis=1)).sum() > 1000


def test_the_draw_skips_the_sort_when_nothing_is_cut_with_the_same_bits():
    """top_k 0 (or at least V) and top_p 1 cut nothing: the logits a token is drawn from are
    filter_logits' bit for bit, without its sort; a NaN logit takes the sort, as do cuts."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((9, 300)).astype(np.float32) * 5
    x[1, :100] = -np.inf
    x[2] = 0.0
    x[2, ::2] = -0.0
    x[3] = -np.inf
    x[4, 7], x[5, 8], x[5, 9] = np.inf, np.inf, -np.inf
    x[6, 3], x[7, ::3], x[8, 5], x[8, 6] = np.nan, np.nan, np.nan, np.inf
    # both compiled, as generation runs them (XLA's division by the traced temperature is not
    # op-by-op NumPy's to the last bit, the same in both)
    filtered = jax.jit(sampling_rules.sampled_logits)
    reference = jax.jit(sampling_rules.filter_logits)
    for rows in (x[:6], x):  # without NaN (the cheap branch when nothing is cut), with NaN
        for settings in [(1.0, 0, 1.0), (0.7, 300, 1.0), (1.3, 900, 1.0), (1.0, 12, 1.0)]:
            for top_p in (1.0, 0.8):
                s = Sampling(settings[0], settings[1], top_p)
                want = np.asarray(reference(rows, s))
                assert np.array_equal(
                    np.asarray(filtered(rows, s)).view(np.uint32), want.view(np.uint32)
                )


def test_each_row_draws_with_its_own_key():
    """Row ``b`` at step ``i`` draws with ``fold_in(fold_in(key(seed), i), b)``: identical
    flat rows draw different tokens, each (checked for four rows) the draw of its own key, and
    a row's token does not change when the other rows of its batch do."""
    B, V, seed, step = 2000, 64, 12345, 3
    flat = jnp.zeros((B, V), jnp.float32)
    sampling = Sampling(1.0, 0, 1.0)
    # as generation runs it: one compilation
    choose = jax.jit(lambda logits, s, seed, i: sampling_rules.choice(s, seed)(logits, i))
    tokens = np.asarray(choose(flat, sampling, seed, step))
    assert len(set(tokens.tolist())) == V  # 2,000 independent uniform draws cover all 64
    step_key = jax.random.fold_in(jax.random.key(seed), step)
    for b in (0, 1, 2, B - 1):
        expected = jax.random.categorical(jax.random.fold_in(step_key, b), flat[b])
        assert int(tokens[b]) == int(expected), b
    # the first half of the rows now certain of token 7: the second half draws what it drew
    peaked = flat.at[: B // 2, 7].set(1e4)
    again = np.asarray(choose(peaked, sampling, seed, step))
    np.testing.assert_array_equal(again[: B // 2], 7)
    np.testing.assert_array_equal(again[B // 2 :], tokens[B // 2 :])
