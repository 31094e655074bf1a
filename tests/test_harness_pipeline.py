"""``evaluation.harness`` in a real Snakemake run: a small packed-sft recipe with the shipped
multiple-choice task trains, is evaluated, reported and published; a task that needs the hub
is refused before anything trains.

Reference: the accuracy counted here from per-choice log-likelihoods of the run's selected
export (the label read from the data file), and the files the pipeline wrote.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import yaml
from conftest import copy_demo_heads, run_snakemake
from harness_by_hand import mc_accuracy

from minifield import recipe as recipes

pytestmark = pytest.mark.slow

LIMIT = 8
#: lines of the demo's train, dev and test files the recipe trains and evaluates on
SLICE = {"train": 64, "dev": 16, "test": 16}


def _project(tmp_path: Path, repo: Path, task_yaml: str | None = None) -> Path:
    """A user's project: a slice of the demo data, the shipped tasks, one small recipe with the
    MC task."""
    workdir = tmp_path / "project"
    shutil.copytree(repo / "data" / "harness", workdir / "data" / "harness")
    # a slice of the demo's examples: what trains the model the harness task is run on is
    # not what this test is about, and every evaluation decodes all of DEV
    copy_demo_heads(repo / "data" / "sft-demo", workdir / "data" / "sft-demo", SLICE)
    if task_yaml is not None:
        (workdir / "data" / "harness" / "reverse_mc.yaml").write_text(task_yaml)
    recipe = yaml.safe_load((repo / "config" / "recipes" / "sft-demo.yaml").read_text())
    recipe["job_id"] = "harness-pipeline"
    for name, path in (("mc", "harness/reverse_mc.yaml"), ("mc-data", "harness/reverse_mc.jsonl")):
        recipe["inputs"].append({"name": name, "path": path})
    for item in recipe["inputs"]:
        item["sha256"] = hashlib.sha256((workdir / "data" / item["path"]).read_bytes()).hexdigest()
    recipe["limits"]["max_steps"] = 12
    recipe["training"]["warmup_steps"] = 2
    recipe["checkpoint"]["every_steps"] = 6
    recipe["evaluation"] = {
        "eval_every": 6,
        "min_dev_exact_match": 0.0,
        "harness": {
            "tasks": [{"name": "minifield_reverse_mc", "config": "mc", "data": "mc-data"}],
            "limit": LIMIT,
            "thresholds": {"minifield_reverse_mc/acc": 0.0},
        },
    }
    (workdir / "config" / "recipes").mkdir(parents=True)
    (workdir / "config" / "recipes" / "harness.yaml").write_text(yaml.safe_dump(recipe))
    config = yaml.safe_load((repo / "config" / "config.yaml").read_text())
    config["recipes"] = ["config/recipes/harness.yaml"]
    config["store"] = {**config["store"], "dir": "store"}
    # the crash proof alone: this test reads no proof (test_proof.py covers both modes)
    config["qualification"] = {**config["qualification"], "mode": "crash"}
    (workdir / "config" / "config.yaml").write_text(yaml.safe_dump(config))
    return workdir


def test_harness_task_runs_in_the_pipeline_and_is_published(tmp_path, repo):
    workdir = _project(tmp_path, repo)
    recipe = recipes.load(workdir / "config" / "recipes" / "harness.yaml")
    base = f"results/computations/{recipe.computation_digest[:16]}"
    # what this test reads: the evaluation, the publication, the evaluation's report page
    # (capacity and the other report pages are the pipeline tests' and the report tests')
    targets = [f"{base}/eval/metrics.json", f"{base}/publication.json"]
    targets.append(f"{base}/report/evaluation.html")
    run_snakemake(workdir, *targets, check=True, timeout=1800)
    (computation,) = (workdir / "results" / "computations").iterdir()
    assert computation.name == recipe.computation_digest[:16]
    metrics = json.loads((computation / "eval" / "metrics.json").read_text())
    harness = metrics["harness"]
    assert harness["samples"] == {"minifield_reverse_mc": LIMIT}

    # the accuracy by hand, from the selected export the pipeline wrote
    (export,) = [p for p in computation.rglob("model.json") if "eval" in p.parts]
    data = workdir / "data" / "harness" / "reverse_mc.jsonl"
    acc = harness["results"]["minifield_reverse_mc"]["acc"]
    assert acc == pytest.approx(mc_accuracy(export.parent, data, LIMIT))
    checks = {c["name"]: c["passed"] for c in metrics["acceptance"]["checks"]}
    assert checks["harness:minifield_reverse_mc/acc"] is True

    publication = json.loads((computation / "publication.json").read_text())
    manifest_path = workdir / "store" / "artifacts" / publication["content_id"] / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    assert manifest["validation"]["harness"]["results"] == harness["results"]
    report = "".join(p.read_text(errors="replace") for p in computation.rglob("*.html"))
    report += "".join(p.read_text(errors="replace") for p in workdir.rglob("report*.html"))
    assert "minifield_reverse_mc" in report


def test_a_task_needing_the_hub_is_refused_before_training(tmp_path, repo):
    shipped = (repo / "data" / "harness" / "reverse_mc.yaml").read_text()
    hub = shipped.replace("dataset_path: json", "dataset_path: someone/some-dataset")
    assert hub != shipped
    workdir = _project(tmp_path, repo, task_yaml=hub)
    proc = run_snakemake(workdir, timeout=900)
    assert proc.returncode != 0
    output = proc.stdout + proc.stderr
    assert "minifield_reverse_mc" in output and "dataset_path" in output
    # nothing trained: no attempt ended anywhere in the project
    assert not list(workdir.rglob("result.json"))
