"""Weighted training mixtures (``training.mixture``) and the recipe side of
``training.grad_accum_steps``.

The data-order checks read the batches as raw rows: every stored row carries its own global
index in its first token, so which source a row came from and how often each row was read
is counted from the rows themselves (the stored source ranges), not from the figures the
code reports about them; those figures are then checked against the counts.
"""

from __future__ import annotations

import copy
import hashlib
import math

import numpy as np
import pytest
from conftest import packed_sft_recipe, small_sft_inputs, small_sft_recipe

from minifield import recipe as recipes
from minifield.data import batches as batches_module
from minifield.data import encoding, packing
from minifield.data import tokenizer as tokenizers
from minifield.strategies.packed_sft import PackedSFT, demo_data

SOURCE_ROWS = (5, 7, 11)
WEIGHTS = (5.0, 3.0, 2.0)
NAMES = ("chat", "code", "math")
SEQ = 4


def synthetic(source_rows=SOURCE_ROWS) -> dict[str, np.ndarray]:
    """Stored rows of three sources, one after another: row ``r`` holds ``r`` in its first
    token, and a row of source ``s`` has ``s + 1`` trained slots."""
    total = sum(source_rows)
    source_of_row = np.repeat(np.arange(len(source_rows)), source_rows)
    tokens = np.zeros((total, SEQ), np.int32)
    tokens[:, 0] = np.arange(total)
    loss_mask = (np.arange(SEQ)[None, :] < (source_of_row[:, None] + 1)).astype(np.float32)
    return {
        "train_tokens": tokens,
        "train_segments": np.ones((total, SEQ), np.int32),
        "train_positions": np.tile(np.arange(SEQ, dtype=np.int32), (total, 1)),
        "train_loss_mask": loss_mask,
        "train_source_rows": np.array(source_rows, np.int64),
    }


def training(batch_size=16, seed=11, weights=WEIGHTS) -> dict:
    mixed = [{"input": n, "weight": w} for n, w in zip(NAMES, weights, strict=True)]
    return {"seed": seed, "batch_size": batch_size, "mixture": mixed}


def test_counts_per_source_match_the_weights_within_a_binomial_bound():
    """Over 1,500 updates of 16 rows every row's source is an independent draw, so a source
    of share p gets Binomial(N, p) rows. A deviation beyond 5 standard deviations has
    probability below 6e-7 per source (two-sided normal tail; N p (1 - p) >= 3,800 here,
    where the normal approximation is tight); the draw is seeded, so the test is exact and
    repeatable, and the bound says how unlucky a correct sampler would have to be."""
    steps, batch_size = 1500, 16
    arrays = synthetic()
    mix = batches_module.MixtureBatches(arrays, training(batch_size))
    bounds = np.cumsum((0, *SOURCE_ROWS))
    drawn = np.zeros((len(NAMES),), np.int64)
    reported = np.zeros_like(drawn)
    times_read = np.zeros(sum(SOURCE_ROWS), np.int64)
    for step in range(steps):
        batch, counts = mix.with_counts(step)
        rows = batch.tokens[:, 0]
        times_read += np.bincount(rows, minlength=len(times_read))
        per_source = np.bincount(np.searchsorted(bounds, rows, side="right") - 1, minlength=3)
        drawn += per_source
        for s, name in enumerate(NAMES):
            figures = counts["sources"][name]
            reported[s] += figures["rows"]
            assert figures["loss_tokens"] == per_source[s] * (s + 1)  # s + 1 trained slots
    n = steps * batch_size
    assert drawn.sum() == n and (reported == drawn).all()
    shares = np.array(WEIGHTS) / sum(WEIGHTS)
    for s in range(len(NAMES)):
        sigma = math.sqrt(n * shares[s] * (1 - shares[s]))
        assert abs(drawn[s] - n * shares[s]) <= 5 * sigma, (NAMES[s], drawn[s], n * shares[s])
    # each source is read in whole epochs of its own: after c draws from a source of m rows,
    # every row of it has been read floor(c / m) or ceil(c / m) times
    for s in range(len(NAMES)):
        mine = times_read[bounds[s] : bounds[s + 1]]
        assert mine.min() == drawn[s] // SOURCE_ROWS[s]
        assert mine.max() == -(-drawn[s] // SOURCE_ROWS[s])
        assert counts["sources"][NAMES[s]]["epochs"] == pytest.approx(drawn[s] / SOURCE_ROWS[s])


def test_the_rows_of_an_update_are_a_pure_function_of_seed_and_step():
    """A process that starts at update 700 (a resume) builds the rows the one that trained
    from update 0 built; another seed gives other rows."""
    arrays = synthetic()
    trained = batches_module.MixtureBatches(arrays, training())
    for step in range(701):
        seen = trained.batch(step)
    resumed = batches_module.MixtureBatches(arrays, training()).batch(700)
    for seen_field, resumed_field in zip(seen, resumed, strict=True):
        np.testing.assert_array_equal(seen_field, resumed_field)
    other = batches_module.MixtureBatches(arrays, training(seed=12)).batch(700)
    assert not np.array_equal(other.tokens, seen.tokens)


# -- recipes: digests, the prepared examples and bad inputs ------------------------------------


def mixture_inputs(root) -> dict:
    """The small reversal splits under ``root/in/sft``, plus a second training source
    ``extra.jsonl`` (40 other words); input root, pins and ``extra``'s sha256."""
    found = small_sft_inputs(root)
    extra = encoding.to_jsonl(demo_data.demo_examples(seed=9, sizes={"train": 40})["train"])
    (root / "in" / "sft" / "extra.jsonl").write_bytes(extra)
    return {**found, "extra": hashlib.sha256(extra).hexdigest()}


def mixed_recipe(space, mixture_entries=None, devices=1, **training_keys) -> dict:
    """The tiny packed-sft recipe over ``train`` (weight 3) and ``extra`` (weight 1)."""
    recipe = small_sft_recipe(space["pins"], "mix", devices, training=training_keys)
    recipe["inputs"].append({"name": "extra", "path": "sft/extra.jsonl", "sha256": space["extra"]})
    entries = mixture_entries or [{"input": "train", "weight": 3}, {"input": "extra", "weight": 1}]
    recipe["training"]["mixture"] = entries
    return recipe


@pytest.fixture(scope="module")
def space(tmp_path_factory) -> dict:
    return mixture_inputs(tmp_path_factory.mktemp("mixture"))


def test_weights_change_the_computation_but_not_the_prepared_examples(space):
    base = recipes.validate(mixed_recipe(space))
    heavier = mixed_recipe(
        space, [{"input": "train", "weight": 3}, {"input": "extra", "weight": 2}]
    )
    changed = recipes.validate(heavier)
    assert changed.computation_digest != base.computation_digest
    assert changed.examples_digest == base.examples_digest  # prepared once per set of sources
    as_floats = mixed_recipe(
        space, [{"input": "train", "weight": 3.0}, {"input": "extra", "weight": 1.0}]
    )
    assert recipes.validate(as_floats).computation_digest == base.computation_digest
    reordered = mixed_recipe(
        space, [{"input": "extra", "weight": 1}, {"input": "train", "weight": 3}]
    )
    assert recipes.validate(reordered).examples_digest != base.examples_digest  # source order


def test_one_train_input_and_accumulation_of_one_are_todays_recipe(space):
    """A one-entry mixture of ``train`` and ``grad_accum_steps: 1`` spell the recipe without
    them: the same digests (the demos' digests are pinned in test_digest.py)."""
    plain = packed_sft_recipe(space["pins"], "mix", training={"batch_size": 8})
    spelled = copy.deepcopy(plain)
    spelled["training"].update(mixture=[{"input": "train", "weight": 7}], grad_accum_steps=1)
    a, b = recipes.validate(plain), recipes.validate(spelled)
    assert (a.computation_digest, a.examples_digest) == (b.computation_digest, b.examples_digest)
    assert "mixture" not in b.data["training"] and "grad_accum_steps" not in b.data["training"]
    accumulated = copy.deepcopy(plain)
    accumulated["training"]["grad_accum_steps"] = 2
    c = recipes.validate(accumulated)
    assert c.computation_digest != a.computation_digest and c.examples_digest == a.examples_digest


@pytest.mark.parametrize(
    ("change", "pointer", "needle"),
    [
        ({"mixture": [{"input": "train", "weight": 0}]}, "/training/mixture/0/weight", "minimum"),
        ({"mixture": [{"input": "train", "weight": -2}]}, "/training/mixture/0/weight", "minimum"),
        ({"grad_accum_steps": 0}, "/training/grad_accum_steps", "minimum of 1"),
        ({"grad_accum_steps": 3}, "/training/grad_accum_steps", "batch_size=8"),
        (
            {"grad_accum_steps": 4, "data_parallel": {"devices": 4}},
            "/training/grad_accum_steps",
            "devices=4",
        ),
        ({"mixture": [{"input": "nope", "weight": 1}]}, "/inputs", "missing ['nope']"),
        ({"mixture": [{"input": "dev", "weight": 1}]}, "/training/mixture/0/input", "held-out"),
        (
            {"mixture": [{"input": "train", "weight": 1}, {"input": "train", "weight": 2}]},
            "/training/mixture/1/input",
            "already a source",
        ),
    ],
)
def test_bad_mixtures_and_accumulation_are_named(space, change, pointer, needle):
    recipe = packed_sft_recipe(space["pins"], "mix", training={"batch_size": 8, **change})
    with pytest.raises(recipes.RecipeError) as raised:
        recipes.validate(recipe, "bad.yaml")
    assert str(raised.value).startswith("bad.yaml: invalid recipe")
    assert any(e["path"] == pointer and needle in e["message"] for e in raised.value.errors), (
        raised.value.errors
    )


def test_prepare_packs_each_source_on_its_own(space):
    recipe = recipes.validate(mixed_recipe(space)).data
    files = {i["name"]: space["input_root"] / i["path"] for i in recipe["inputs"]}
    arrays, meta = PackedSFT().prepare(recipe, files)
    byte, seq = tokenizers.byte_tokenizer(), recipe["training"]["seq_len"]
    separately = {
        name: packing.pack(encoding.encode_file(files[name], byte), seq, "truncate", byte.pad_id)
        for name in ("train", "extra")
    }
    rows = [separately[n].stats["rows"] for n in ("train", "extra")]
    assert arrays["train_source_rows"].tolist() == rows
    np.testing.assert_array_equal(
        arrays["train_tokens"],
        np.concatenate([separately[n].rows.tokens for n in ("train", "extra")]),
    )
    assert meta["mixture"]["extra"]["examples"] == 40
    assert meta["splits"]["train"]["rows"] == sum(rows)


# -- the summary: what the final state trained on, per source ----------------------------------


def _update(step: int, figures: dict) -> dict:
    return {"type": "update", "step": step, "sources": figures}


def test_the_summary_counts_each_update_of_the_final_state_once():
    """Figures by step (the summary keeps each step's latest, a redone update's as redone;
    test_mixture_worker.py checks that over a real crash), summed by hand: rows and trained
    tokens of updates 1-3 of a state at position 3 (update 4 was lost with a crash), epochs
    as after update 3."""
    from minifield.observe.summarize import trained_by_source

    one = {
        "a": {"rows": 3, "loss_tokens": 30, "epochs": 0.5},
        "b": {"rows": 1, "loss_tokens": 4, "epochs": 0.25},
    }
    two = {
        "a": {"rows": 2, "loss_tokens": 20, "epochs": 0.8333},
        "b": {"rows": 2, "loss_tokens": 8, "epochs": 0.75},
    }
    three = {
        "a": {"rows": 4, "loss_tokens": 40, "epochs": 1.5},
        "b": {"rows": 0, "loss_tokens": 0, "epochs": 0.75},
    }
    by_step = {1: one, 2: two, 3: three, 4: one}
    assert trained_by_source(by_step, position=3) == {
        "a": {"trained_rows_count": 9, "trained_loss_tokens_count": 90, "epochs_count": 1.5},
        "b": {"trained_rows_count": 3, "trained_loss_tokens_count": 12, "epochs_count": 0.75},
    }


def test_the_report_shows_the_sources(tmp_path):
    from minifield.observe.report import training as report

    summary = {
        "sources": {
            "chat": {"trained_rows_count": 9, "trained_loss_tokens_count": 90, "epochs_count": 1.5}
        }
    }
    html = report.sources_section(summary)
    assert "chat" in html and "90" in html and "1.5" in html
    assert report.sources_section({}) == ""
