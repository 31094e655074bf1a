"""A mixture's training sources prepared each on its own (``results/sources/{sdigest}``):
which settings address a source, and the examples assembled from prepared sources equal the
examples prepared in one piece (the reference: the one-piece path, itself checked against
each source packed by hand in test_mixtures.py)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from test_mixtures import mixed_recipe, mixture_inputs

from minifield import recipe as recipes
from minifield.digest import short
from minifield.inputs import examples
from minifield.pipeline import preparation


@pytest.fixture(scope="module")
def space(tmp_path_factory) -> dict:
    return mixture_inputs(tmp_path_factory.mktemp("sources"))


def _digests(recipe: dict) -> dict[str, str]:
    return recipes.validate(recipe).source_digests


def test_a_source_is_addressed_by_its_file_and_encoding_not_by_its_partners(space):
    both = _digests(mixed_recipe(space))
    assert set(both) == {"train", "extra"} and both["train"] != both["extra"]
    # the same file in another mixture: another partner (the held-out dev file as a training
    # source under another name), another weight, another order, another name for it
    other = mixed_recipe(space, [{"input": "more", "weight": 2}, {"input": "again", "weight": 5}])
    train = next(i for i in other["inputs"] if i["name"] == "train")
    other["inputs"] = [i for i in other["inputs"] if i["name"] not in ("train", "extra")] + [
        {"name": "more", "path": "sft/dev.jsonl", "sha256": space["pins"]["dev"]},
        {"name": "again", "path": "sft/extra.jsonl", "sha256": space["extra"]},
    ]
    assert train["sha256"] != space["pins"]["dev"]
    assert _digests(other)["again"] == both["extra"]
    # what changes its rows changes its address
    assert _digests(mixed_recipe(space, seq_len=48))["extra"] != both["extra"]
    assert _digests(mixed_recipe(space, train_on="last_assistant"))["extra"] != both["extra"]
    assert _digests(mixed_recipe(space, overlong="reject"))["extra"] != both["extra"]
    # what does not, does not: the seed, the learning rate
    assert _digests(mixed_recipe(space, seed=99, learning_rate=0.5)) == both


def test_without_a_mixture_nothing_is_prepared_on_its_own(space):
    single = mixed_recipe(space)
    del single["training"]["mixture"]
    single["inputs"] = [i for i in single["inputs"] if i["name"] != "extra"]
    assert _digests(single) == {}


def test_examples_from_prepared_sources_equal_the_examples_prepared_at_once(space, tmp_path):
    recipe_json = tmp_path / "recipe.json"
    recipe_json.write_text(json.dumps(mixed_recipe(space)))
    root = space["input_root"]
    whole = preparation.prepare(recipe_json, root, tmp_path / "whole")
    digests = recipes.load(recipe_json).source_digests
    for name, digest in digests.items():
        preparation.prepare_source(recipe_json, root, name, tmp_path / "sources" / short(digest))
    assembled = preparation.prepare(recipe_json, root, tmp_path / "assembled", tmp_path / "sources")
    assert assembled["arrays"] == whole["arrays"]  # every array's name, dtype, shape, sha256
    assert assembled["meta"] == whole["meta"]
    # the assembled examples did read the prepared sources: a source altered on disk is refused
    source_dir = tmp_path / "sources" / short(digests["extra"])
    tokens = source_dir / "tokens.npy"
    altered = np.load(tokens)
    altered[0, 0] += 1
    np.save(tokens, altered)
    with pytest.raises(examples.ExamplesError, match="tokens.npy: missing or sha256 differs"):
        preparation.prepare(recipe_json, root, tmp_path / "again", tmp_path / "sources")
    assert not (tmp_path / "again" / "manifest.json").exists()
