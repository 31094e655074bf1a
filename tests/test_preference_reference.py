"""The reference log-probabilities as a product: one address for recipes that differ only in
the loss or β, another when the pairs change; the numbers against the float64 NumPy forward;
read back by a DPO recipe, whose first loss is then ln 2; refused when tampered with (by its
pin) or computed for other pairs (by its recorded digest); bad recipes named."""

from __future__ import annotations

import json
import math

import jax
import numpy as np
import pytest
from conftest import write_recipe
from family_reference import reference_logits
from preference_cases import BASE_DIR, make_inputs, recipe, sha, with_reference
from safetensors.numpy import load_file

from minifield import recipe as recipes
from minifield.inputs import pinned
from minifield.pipeline import reference_logprobs
from minifield.strategies.preference import pairs, reference

DPO = {"loss": "dpo", "beta": 0.5}


@pytest.fixture(scope="module")
def computed(tmp_path_factory):
    root = make_inputs(tmp_path_factory.mktemp("pref") / "in")
    record = reference.compute(
        recipes.validate(recipe(root, {"loss": "simpo"})), root, root / "ref"
    )
    return root, record


def test_the_address_ignores_the_loss_and_beta_and_follows_the_pairs(computed, tmp_path):
    root, record = computed
    digests = {
        reference.reference_digest(recipes.validate(recipe(root, settings)), root)
        for settings in ({"loss": "simpo"}, {"loss": "orpo"}, {"loss": "simpo", "beta": 5.0})
    }
    pinned_dpo = with_reference(recipe(root, DPO), root, "ref/reference.safetensors")
    digests.add(reference.reference_digest(recipes.validate(pinned_dpo), root))
    # a DPO recipe before its reference exists (the stage that computes it): a placeholder
    unpinned = write_recipe(tmp_path / "dpo.json", recipe(root, DPO | {"reference": "ref"}))
    digests.add(reference_logprobs.digest(unpinned, root))
    assert digests == {record["digest"]}
    edited = make_inputs(tmp_path / "in")
    path = edited / "pairs" / "dev.jsonl"
    path.write_text(path.read_text().replace('"chosen": "', '"chosen": "z', 1))
    moved = write_recipe(tmp_path / "edited.json", recipe(edited, DPO | {"reference": "ref"}))
    assert reference_logprobs.digest(moved, edited) != record["digest"]
    with pytest.raises(recipes.RecipeError, match="/preference/beta"):
        reference_logprobs.digest(
            write_recipe(tmp_path / "b.json", recipe(root, DPO | {"beta": 0, "reference": "r"})),
            root,
        )


def test_the_file_holds_each_pairs_base_log_probs_as_the_numpy_forward_gives(computed):
    root, record = computed
    path = root / "ref" / reference.DATA_FILE
    assert record["files"][reference.DATA_FILE] == sha(path)
    assert json.loads((root / "ref" / reference.RECORD_FILE).read_text()) == record
    tensors = load_file(path)
    hf = json.loads((BASE_DIR / "config.json").read_text())
    weights = load_file(BASE_DIR / "model.safetensors")
    loaded = recipes.validate(recipe(root, {"loss": "simpo"}))
    files = pinned.files_by_name(loaded.data, root)
    from minifield.hf import pinned_base

    arrays, _ = pinned_base.load(loaded.data, files)
    chat = pinned_base.tokenizer_from_arrays(loaded.data, arrays)
    encoded = pairs.encode(pairs.read(files["dev"]), *chat)
    assert tensors["dev.chosen"].shape == (len(encoded),) == (record["splits"]["dev"]["pairs"],)
    for index in (0, 3, 6):
        p = encoded[index]
        for side, answer in (("chosen", p.chosen), ("rejected", p.rejected)):
            ids = p.prompt + answer
            logits = reference_logits(weights, hf, ids)
            top = logits.max(-1, keepdims=True)
            logp = logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True))
            want = sum(logp[t - 1, ids[t]] for t in range(len(p.prompt), len(ids)))
            assert abs(float(tensors[f"dev.{side}"][index]) - want) < 1e-4


# 25-40 s of compiling on this machine: in the slow tier, so the fast tier stays a quick loop
@pytest.mark.slow
def test_a_dpo_recipe_reads_it_and_starts_at_ln2(computed):
    root, _ = computed
    loaded = recipes.validate(with_reference(recipe(root, DPO), root, "ref/reference.safetensors"))
    arrays, _ = loaded.strategy.prepare(loaded.data, pinned.files_by_name(loaded.data, root))
    program = loaded.strategy.build(loaded.data, arrays)
    state = program.place(program.init_state())
    metrics = program.evaluate(state)  # policy = reference: every reward margin is 0
    assert metrics["dev_loss"] == pytest.approx(math.log(2), abs=1e-5)
    assert metrics["dev_reward_margin"] == pytest.approx(0.0, abs=1e-4)
    _, first = program.step(state)
    assert first["loss"] == pytest.approx(math.log(2), abs=1e-5)
    assert first["pairs"] == loaded.data["training"]["batch_size"]
    jax.clear_caches()


def test_a_tampered_reference_is_refused_by_its_pin(computed, tmp_path):
    root, _ = computed
    loaded = recipes.validate(with_reference(recipe(root, DPO), root, "ref/reference.safetensors"))
    tampered = tmp_path / "in"
    make_inputs(tampered)
    (tampered / "ref").mkdir()
    data = bytearray((root / "ref" / reference.DATA_FILE).read_bytes())
    data[-1] ^= 1
    (tampered / "ref" / reference.DATA_FILE).write_bytes(bytes(data))
    with pytest.raises(pinned.InputError, match="reference.safetensors has sha256"):
        pinned.verify(loaded.data, tampered)


def test_a_reference_computed_for_other_pairs_is_refused_naming_the_file(computed, tmp_path):
    root, _ = computed
    other = make_inputs(tmp_path / "other", seed=12)
    reference.compute(recipes.validate(recipe(other, {"loss": "simpo"})), other, other / "ref")
    # this recipe's pairs, the other pairs' reference file (pinned with its true sha256)
    (root / "foreign").mkdir(exist_ok=True)
    foreign = root / "foreign" / reference.DATA_FILE
    foreign.write_bytes((other / "ref" / reference.DATA_FILE).read_bytes())
    loaded = recipes.validate(
        with_reference(recipe(root, DPO), root, "foreign/reference.safetensors")
    )
    with pytest.raises(reference.ReferenceError, match=f"{foreign}: computed for reference digest"):
        loaded.strategy.prepare(loaded.data, pinned.files_by_name(loaded.data, root))


@pytest.mark.parametrize(
    ("preference", "pointer"),
    [
        ({"loss": "dpo", "beta": 0.0}, "/preference/beta"),
        ({"loss": "simpo", "beta": -1.0}, "/preference/beta"),
        ({"loss": "dpo"}, "/preference/reference"),
        ({"loss": "dpo", "label_smoothing": 0.5, "reference": "r"}, "/preference/label_smoothing"),
        ({"loss": "simpo", "label_smoothing": 0.1}, "/preference/label_smoothing"),
        ({"loss": "orpo", "reference": "r"}, "/preference/reference"),
        ({"loss": "kto"}, "/preference/loss"),
        ({"loss": "dpo", "rpo_alpha": -0.5, "reference": "r"}, "/preference/rpo_alpha"),
        ({"loss": "simpo", "rpo_alpha": 1.0}, "/preference/rpo_alpha"),
        ({"loss": "orpo", "rpo_alpha": 1.0}, "/preference/rpo_alpha"),
    ],
)
def test_bad_preference_settings_are_named(computed, preference, pointer):
    root, _ = computed
    with pytest.raises(recipes.RecipeError) as caught:
        recipes.validate(recipe(root, preference))
    assert pointer in [e["path"] for e in caught.value.errors], caught.value.errors


def test_a_recipe_without_the_preference_section_gets_that_one_error(computed):
    """Every other check reads ``preference``, so its absence is the only thing said."""
    root, _ = computed
    raw = recipe(root, {"loss": "simpo"})
    del raw["preference"]
    with pytest.raises(recipes.RecipeError) as caught:
        recipes.validate(raw)
    expected = [{"path": "/preference", "message": "the preference strategy needs it"}]
    assert caught.value.errors == expected


def test_the_preference_section_is_refused_by_other_strategies_and_kept_in_the_digest(computed):
    root, _ = computed
    sft = recipe(root, {"loss": "simpo"}, strategy={"name": "packed-sft", "version": "12.0.0"})
    with pytest.raises(recipes.RecipeError, match="/preference"):
        recipes.validate(sft)
    one = recipes.validate(recipe(root, {"loss": "simpo", "beta": 2.0}))
    same = recipes.validate(recipe(root, {"loss": "simpo", "beta": 2, "gamma": 0.5}))
    other = recipes.validate(recipe(root, {"loss": "simpo", "beta": 3.0}))
    assert one.computation_digest == same.computation_digest != other.computation_digest
    assert one.examples_digest == other.examples_digest  # a β sweep shares its examples


def test_rpo_alpha_zero_is_the_plain_dpo_computation_and_any_other_value_another(computed):
    """rpo_alpha 0 is spelled by its absence (DPO recipes written before the key keep their
    digest); 1.0 is another computation, with the same examples."""
    root, _ = computed

    def validated(**extra):
        raw = recipe(root, DPO | {"reference": "reference"} | extra)
        raw["inputs"].append({"name": "reference", "path": "ref/x", "sha256": "1" * 64})
        return recipes.validate(raw)

    plain, zero, rpo = validated(), validated(rpo_alpha=0), validated(rpo_alpha=1.0)
    assert "rpo_alpha" not in zero.data["preference"]
    assert plain.computation_digest == zero.computation_digest != rpo.computation_digest
    assert rpo.data["preference"]["rpo_alpha"] == 1.0
    assert plain.examples_digest == rpo.examples_digest


def test_dpo_acceptance_checks_reward_accuracy_when_measured_and_preference_accuracy_always(
    computed,
):
    root, _ = computed
    settings = DPO | {"reference": "reference"}
    raw = recipe(root, settings, evaluation={"min_dev_preference_accuracy": 0.75})
    raw["evaluation"]["min_dev_reward_accuracy"] = 0.5
    raw["inputs"].append({"name": "reference", "path": "ref/x", "sha256": "1" * 64})
    loaded = recipes.validate(raw)

    def verdict(**metrics):
        result = loaded.strategy.acceptance(loaded.data, metrics)
        return result["passed"], [c["name"] for c in result["checks"] if not c["passed"]]

    # training's evaluation: both measured, both checked
    assert verdict(dev_preference_accuracy=0.75, dev_reward_accuracy=0.5) == (True, [])
    assert verdict(dev_preference_accuracy=0.75, dev_reward_accuracy=0.25) == (
        False,
        ["dev_reward_accuracy"],
    )
    # the gate's re-evaluation from an export (no reference): preference accuracy only
    assert verdict(dev_preference_accuracy=0.75) == (True, [])
    assert verdict(dev_preference_accuracy=0.5) == (False, ["dev_preference_accuracy"])
    assert verdict() == (False, ["dev_preference_accuracy"])
