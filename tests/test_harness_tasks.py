"""Harness tasks from pinned files, offline (``minifield.harness.tasks``), their thresholds
and the store gate's re-check; ``minifield validate --input-root`` refusing bad task files.

References: the shipped task files read here with PyYAML, hashlib for pins, and the rules of
docs/harness.md written out case by case. Fast tier: no process, no lm-eval import.
"""

from __future__ import annotations

import copy
import hashlib
import shutil

import pytest
from conftest import TINY_SFT, packed_sft_recipe, small_sft_inputs, write_recipe

from minifield import cli
from minifield import recipe as recipes
from minifield.harness import tasks, thresholds
from minifield.store import gate

MC = {"name": "minifield_reverse_mc", "config": "mc", "data": "mc-data"}


@pytest.fixture
def pinned(tmp_path, repo):
    """A tiny packed-sft recipe over small inputs plus the shipped multiple-choice task."""
    made = small_sft_inputs(tmp_path)
    root = made["input_root"]
    shutil.copytree(repo / "data" / "harness", root / "harness")
    recipe = packed_sft_recipe(made["pins"], "harness-test", **TINY_SFT)
    recipe["inputs"] += [
        _pin(root, "mc", "harness/reverse_mc.yaml"),
        _pin(root, "mc-data", "harness/reverse_mc.jsonl"),
    ]
    recipe["evaluation"]["harness"] = {"tasks": [dict(MC)]}
    return root, recipe


def _pin(root, name, path):
    return {
        "name": name,
        "path": path,
        "sha256": hashlib.sha256((root / path).read_bytes()).hexdigest(),
    }


def _repin(root, recipe, name):
    item = next(i for i in recipe["inputs"] if i["name"] == name)
    item["sha256"] = hashlib.sha256((root / item["path"]).read_bytes()).hexdigest()


def _validate(tmp_path, recipe, root, capsys) -> tuple[int, str]:
    path = write_recipe(tmp_path / "recipe.json", recipe)
    before = sorted(p for p in tmp_path.rglob("*"))
    code = cli.main(["validate", str(path), "--input-root", str(root)])
    assert sorted(p for p in tmp_path.rglob("*")) == before  # nothing written
    return code, capsys.readouterr().err


def test_a_shipped_task_is_rewritten_to_read_its_pinned_file(pinned):
    root, recipe = pinned
    (resolved,) = tasks.resolve_pinned(recipe, root)
    assert resolved["task"] == "minifield_reverse_mc"
    assert resolved["dataset_path"] == "json"
    assert resolved["dataset_kwargs"] == {
        "data_files": {"test": str((root / "harness" / "reverse_mc.jsonl").resolve())}
    }
    assert tasks.pinned_sha256(recipe) == {
        "minifield_reverse_mc": {
            "config": recipe["inputs"][3]["sha256"],
            "data": recipe["inputs"][4]["sha256"],
        }
    }


def test_both_shipped_tasks_resolve(repo):
    files = {
        n: repo / "data" / "harness" / n
        for n in ("reverse_mc.yaml", "reverse_mc.jsonl", "reverse_gen.yaml", "reverse_gen.jsonl")
    }
    gen = {
        "name": "minifield_reverse_gen",
        "config": "reverse_gen.yaml",
        "data": "reverse_gen.jsonl",
    }
    mc = {"name": "minifield_reverse_mc", "config": "reverse_mc.yaml", "data": "reverse_mc.jsonl"}
    assert tasks.resolve(gen, files)["output_type"] == "generate_until"
    assert tasks.resolve(mc, files)["output_type"] == "multiple_choice"


def test_a_good_recipe_validates_with_its_input_root(pinned, tmp_path, capsys):
    root, recipe = pinned
    code, err = _validate(tmp_path, recipe, root, capsys)
    assert (code, err) == (0, "")


@pytest.mark.parametrize(
    "change, field",
    [
        (
            "task: minifield_reverse_mc\n",
            "task: the file defines task 'something_else'",
        ),  # unknown task
        ("dataset_path: json\n", "dataset_path: 'super_glue'"),  # needs the hub
        ("    test: reverse_mc.jsonl\n", "dataset_kwargs.data_files.test: the dataset file "),
        ("  - metric: acc\n", "metric_list[0].metric: 'bleurt'"),
        ("output_type: multiple_choice\n", "config: uses a YAML tag"),
    ],
)
def test_a_task_file_that_cannot_run_offline_exits_2_naming_task_and_field(
    pinned, tmp_path, capsys, change, field
):
    root, recipe = pinned
    path = root / "harness" / "reverse_mc.yaml"
    replacement = {
        "task: minifield_reverse_mc\n": "task: something_else\n",
        "dataset_path: json\n": "dataset_path: super_glue\n",
        "    test: reverse_mc.jsonl\n": "    test: missing.jsonl\n",
        "  - metric: acc\n": "  - metric: bleurt\n",
        "output_type: multiple_choice\n": "output_type: multiple_choice\nprocess_docs: !function utils.process\n",
    }[change]
    text = path.read_text()
    assert change in text
    path.write_text(text.replace(change, replacement))
    _repin(root, recipe, "mc")
    code, err = _validate(tmp_path, recipe, root, capsys)
    assert code == 2
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert "harness task 'minifield_reverse_mc'" in err and field in err, err


def test_an_unpinned_task_file_is_refused_at_validation_naming_task_and_field(
    pinned, tmp_path, capsys
):
    root, recipe = pinned
    recipe["inputs"] = [i for i in recipe["inputs"] if i["name"] != "mc"]
    code, err = _validate(tmp_path, recipe, root, capsys)
    assert code == 2
    assert "/evaluation/harness/tasks/0/config" in err and "'minifield_reverse_mc'" in err
    with pytest.raises(recipes.RecipeError, match="not a pinned input"):
        recipes.validate(recipe, "r")


def test_a_missing_pinned_dataset_exits_2(pinned, tmp_path, capsys):
    root, recipe = pinned
    (root / "harness" / "reverse_mc.jsonl").unlink()
    code, err = _validate(tmp_path, recipe, root, capsys)
    assert code == 2 and "mc-data" in err and len(err.strip().splitlines()) == 1, err


def test_harness_keys_change_the_digest_and_recipes_without_them_keep_theirs(pinned):
    _, recipe = pinned
    without = copy.deepcopy(recipe)
    del without["evaluation"]["harness"]
    without["inputs"] = without["inputs"][:3]
    plain = packed_sft_recipe(
        {i["name"]: i["sha256"] for i in without["inputs"]}, "harness-test", **TINY_SFT
    )
    assert (
        recipes.validate(without, "a").computation_digest
        == recipes.validate(plain, "b").computation_digest
    )
    digests = {recipes.validate(copy.deepcopy(recipe), "r").computation_digest}
    for key, value in (
        ("limit", 5),
        ("num_fewshot", 2),
        ("thresholds", {"minifield_reverse_mc/acc": 0.5}),
    ):
        changed = copy.deepcopy(recipe)
        changed["evaluation"]["harness"][key] = value
        digests.add(recipes.validate(changed, "r").computation_digest)
    assert len(digests) == 4


def test_thresholds_pass_only_at_or_above_the_value():
    results = {"t": {"acc": 0.5, "exact_match": float("nan")}}
    checks = thresholds.checks(
        {"t/acc": 0.5, "t/exact_match": 0.0, "t/f1": 0.0, "u/acc": 0.1}, results
    )
    assert [(c["name"], c["passed"]) for c in checks] == [
        ("harness:t/acc", True),
        ("harness:t/exact_match", False),  # not finite
        ("harness:t/f1", False),  # not measured
        ("harness:u/acc", False),
    ]
    assert not thresholds.checks({"t/acc": 0.51}, results)[0]["passed"]


def test_the_gate_rechecks_thresholds_against_the_recorded_results(pinned):
    _, recipe = pinned
    recipe["evaluation"]["harness"]["thresholds"] = {"minifield_reverse_mc/acc": 0.5}
    validated = recipes.validate(recipe, "r")
    record = {
        "results": {"minifield_reverse_mc": {"acc": 0.75}},
        "tasks": tasks.pinned_sha256(validated.data),
    }
    manifest = {"validation": {"harness": record}}
    assert gate.harness_reasons(manifest, validated) == []
    lowered = copy.deepcopy(manifest)
    lowered["validation"]["harness"]["results"]["minifield_reverse_mc"]["acc"] = 0.25
    assert gate.harness_reasons(lowered, validated) == [
        "harness threshold failed: harness:minifield_reverse_mc/acc=0.25 (at least 0.5)"
    ]
    other = copy.deepcopy(manifest)
    other["validation"]["harness"]["tasks"]["minifield_reverse_mc"]["data"] = "0" * 64
    assert "not computed from the task files" in gate.harness_reasons(other, validated)[0]
    assert "records no harness results" in gate.harness_reasons({"validation": {}}, validated)[0]
