"""The evaluate stage with ``evaluation.harness``: a tiny packed-sft run trained by a real
worker, then the shipped multiple-choice task on its DEV-selected export, recorded in the
metrics, the acceptance and the store manifest.

Reference: the accuracy computed here from per-choice log-likelihoods of the selected export
(one ``loglikelihood`` request per choice, the argmax against the label read from the data
file), and the threshold rule (result >= value) applied by hand. A worker run: slow tier.
"""

from __future__ import annotations

import hashlib
import json
import shutil

import pytest
from conftest import TINY_SFT, packed_sft_recipe, run_worker, small_sft_inputs, write_recipe
from harness_by_hand import mc_accuracy

from minifield.pipeline import evaluation, preparation
from minifield.pipeline.errors import StageError
from minifield.store import manifest as manifests

pytestmark = pytest.mark.slow


def _pin(root, name, path):
    digest = hashlib.sha256((root / path).read_bytes()).hexdigest()
    return {"name": name, "path": path, "sha256": digest}


def test_harness_task_on_the_selected_export_in_metrics_acceptance_and_manifest(tmp_path, repo):
    made = small_sft_inputs(tmp_path)
    root = made["input_root"]
    shutil.copytree(repo / "data" / "harness", root / "harness")
    raw = packed_sft_recipe(made["pins"], "harness-stage", **TINY_SFT)
    raw["inputs"] += [
        _pin(root, "mc", "harness/reverse_mc.yaml"),
        _pin(root, "mc-data", "harness/reverse_mc.jsonl"),
    ]
    raw["evaluation"]["harness"] = {
        "tasks": [{"name": "minifield_reverse_mc", "config": "mc", "data": "mc-data"}],
        "limit": 12,
        # one threshold any accuracy meets; one no result can (acc_norm is not measured by the task)
        "thresholds": {"minifield_reverse_mc/acc": 0.0, "minifield_reverse_mc/acc_norm": 1.01},
    }
    job = write_recipe(tmp_path / "job.json", raw)
    recipe_json = tmp_path / "recipe.json"
    preparation.validate(job, recipe_json, tmp_path / "validation.json")
    preparation.hash_inputs(recipe_json, root, tmp_path / "inputs.json")
    preparation.prepare(recipe_json, root, tmp_path / "examples")
    run_worker(job=recipe_json, input_root=root, output_root=tmp_path / "out", check_codes=(0,))
    (attempt,) = (tmp_path / "out" / "harness-stage").iterdir()
    result = json.loads((attempt / "result.json").read_text())
    train_result = tmp_path / "train-result.json"
    train_result.write_text(json.dumps({**result, "attempt_dir": str(attempt)}))

    with pytest.raises(StageError, match="input root is needed"):  # before any checkpoint work
        evaluation.evaluate(recipe_json, train_result, tmp_path / "examples", tmp_path / "m.json")
    assert not (tmp_path / "m.json").exists()

    export = tmp_path / "selected-export"
    metrics = evaluation.evaluate(
        recipe_json, train_result, tmp_path / "examples", tmp_path / "metrics.json", export, root
    )
    harness = metrics["harness"]
    assert harness["samples"] == {"minifield_reverse_mc": 12}
    assert harness["tasks"]["minifield_reverse_mc"] == {
        "config": raw["inputs"][3]["sha256"],
        "data": raw["inputs"][4]["sha256"],
    }

    # accuracy by hand from per-choice log-likelihoods of the selected export
    acc = harness["results"]["minifield_reverse_mc"]["acc"]
    assert acc == pytest.approx(mc_accuracy(export, root / "harness/reverse_mc.jsonl", 12))

    checks = {c["name"]: c for c in metrics["acceptance"]["checks"]}
    assert checks["harness:minifield_reverse_mc/acc"]["passed"] is True
    assert checks["harness:minifield_reverse_mc/acc_norm"]["passed"] is False
    assert metrics["acceptance"]["passed"] is False
    # what publication records of it: the gate re-checks the thresholds against these
    built = manifests._validation(
        tmp_path / "metrics.json",
        {"computation_digest": metrics["computation_digest"], "final_state_hash": None},
    )
    assert built["harness"]["results"] == harness["results"]
