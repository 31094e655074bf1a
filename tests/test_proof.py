"""The recovery proof and the qualification gate, through a real Snakemake run of the demo."""

from __future__ import annotations

import copy
import hashlib
import json
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest
import yaml
from conftest import REPO, copy_run, linear_recipe, run_snakemake, write_recipe

from minifield import recovery
from minifield.recipe import load_schema

pytestmark = pytest.mark.slow  # real Snakemake runs and the prove CLI


def _events(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory, linear_demo_run) -> dict:
    """The linear demo pipeline (validate → … → qualify → train → evaluate), a private copy."""
    workdir = copy_run(linear_demo_run, tmp_path_factory.mktemp("proof") / "project")
    (cdir,) = (workdir / "results" / "computations").iterdir()
    return {
        "workdir": workdir,
        "cdir": cdir,
        "proof": json.loads((cdir / "qualification" / "proof.json").read_text()),
    }


def test_demo_proof_passes_and_its_evidence_checks_out(pipeline):
    proof, cdir, workdir = pipeline["proof"], pipeline["cdir"], pipeline["workdir"]
    jsonschema.validate(proof, load_schema("proof.schema.json"))
    assert proof["passed"] is True and proof["first_divergence"] is None
    print("\ndemo proof diagnosis:", proof["diagnosis"])
    validation = json.loads((cdir / "validation.json").read_text())
    assert proof["computation_digest"] == validation["computation_digest"]
    steps, k = proof["settings"]["steps"], proof["settings"]["fail_after_step"]
    every = proof["settings"]["every_steps"]
    # defaults documented in config/README.md: steps = min(max_steps, 2*every+2), k = every+1
    assert (steps, k) == (min(proof["settings"]["max_steps"], 2 * every + 2), every + 1)

    # paths in the proof are as the pipeline gave them (relative to its working directory)
    runs = {
        name: workdir / proof[name]["attempt_dir"] for name in ("reference", "faulted", "resumed")
    }
    for run in runs.values():
        # same computation in every run: the step limit and fault flags are not part of it
        info = json.loads((run / "attempt.json").read_text())
        assert info["computation_digest"] == validation["computation_digest"]
    ref = {
        e["step"]: e for e in _events(runs["reference"] / "events.jsonl") if e["type"] == "update"
    }
    res = {e["step"]: e for e in _events(runs["resumed"] / "events.jsonl") if e["type"] == "update"}
    assert sorted(ref) == list(range(1, steps + 1))
    assert proof["reference"]["state_hashes"] == [
        {"step": s, "state_hash": ref[s]["state_hash"]} for s in sorted(ref)
    ]
    assert proof["resumed"]["state_hashes"] == [
        {"step": s, "state_hash": res[s]["state_hash"]} for s in sorted(res)
    ]

    # the faulted process crashed right after update k and is gone; its logs are kept
    faulted = proof["faulted"]
    assert faulted["exit_code"] == 1 and faulted["classification"] == "failed"
    assert faulted["exited"] is True and not Path(f"/proc/{faulted['pid']}").exists()
    assert faulted["last_update_step"] == k
    assert "update 3/" in (workdir / faulted["stderr_log"]).read_text()
    assert (workdir / faulted["run_json"]).is_file()

    # checkpoint used: the newest committed one, at or before k, verified by hand here too
    used = proof["checkpoint_used"]
    assert used["step"] == (k // every) * every and used["step"] <= k
    manifest_path = workdir / used["path"] / "manifest.json"
    assert hashlib.sha256(manifest_path.read_bytes()).hexdigest() == used["sha256"]
    manifest = json.loads(manifest_path.read_text())
    for entry in manifest["arrays"]:
        data = (workdir / used["path"] / entry["file"]).read_bytes()
        assert hashlib.sha256(data).hexdigest() == entry["sha256"]
    assert manifest["state_hash"] == ref[used["step"]]["state_hash"]

    # next update and every later hash equal the reference (checked from the raw events)
    nxt = proof["next_update"]
    assert nxt["step"] == used["step"] + 1 and nxt["equal"] is True
    assert (
        nxt["resumed"] == res[used["step"] + 1]["state_hash"] == ref[used["step"] + 1]["state_hash"]
    )
    for step in range(used["step"] + 1, steps + 1):
        assert res[step]["state_hash"] == ref[step]["state_hash"]
        assert res[step]["part_hashes"] == ref[step]["part_hashes"]

    # training ran only after the proof, under the supervisor
    result = json.loads((cdir / "train" / "result.json").read_text())
    assert result["status"] == "completed"
    run = json.loads((workdir / result["supervision"]["run_json"]).read_text())
    assert run["classification"] == "completed"


def test_divergence_names_the_step_and_the_state_part(pipeline):
    """compare() on the demo's real reference events, with one part of one update altered."""
    proof = pipeline["proof"]
    ref_dir = pipeline["workdir"] / proof["reference"]["attempt_dir"]
    ref = {e["step"]: e for e in _events(ref_dir / "events.jsonl") if e["type"] == "update"}
    steps, start = proof["settings"]["steps"], proof["checkpoint_used"]["step"]
    resumed = copy.deepcopy(ref)
    bad = start + 2
    resumed[bad]["state_hash"] = "0" * 64
    resumed[bad]["part_hashes"]["opt_state"] = "0" * 64
    result = recovery.compare(
        ref,
        resumed,
        restored_step=start,
        restored_state_hash=ref[start]["state_hash"],
        steps=steps,
    )
    div = result["first_divergence"]
    assert div["step"] == bad and div["parts"] == ["opt_state"] and div["what"] == "update"
    assert result["next_update"]["equal"] is True
    text = recovery._diagnosis(
        {
            "passed": False,
            "first_divergence": div,
            "checkpoint_used": {"step": start},
            "problem": None,
        }
    )
    assert f"step {bad}" in text and "optimizer state" in text

    del resumed[bad]
    div = recovery.compare(
        ref, resumed, restored_step=start, restored_state_hash="f" * 64, steps=steps
    )["first_divergence"]
    assert div["step"] == start and div["what"] == "restored checkpoint"


def test_failing_proof_stops_the_pipeline_with_its_diagnosis(pipeline, tmp_path):
    """A fault point before the first checkpoint cannot prove recovery: qualify fails and
    train does not run again."""
    workdir = pipeline["workdir"]
    runs_before = sorted((workdir / "work").glob("*/runs/*"))
    override = tmp_path / "failing.yaml"
    override.write_text(yaml.safe_dump({"qualification": {"fail_after_step": 1}}))
    proc = run_snakemake(workdir, "--nolock", "--configfile", str(override))
    assert proc.returncode != 0
    log = (workdir / "logs" / "qualify" / f"{pipeline['cdir'].name}.log").read_text()
    assert "before the first checkpoint" in log
    assert "training is blocked" in proc.stderr + log
    assert sorted((workdir / "work").glob("*/runs/*")) == runs_before  # no training attempt
    assert not (pipeline["cdir"] / "qualification" / "proof.json").exists()
    kept = sorted((workdir / "work").glob("*/qualification/*/proof.json"))
    assert json.loads(kept[-1].read_text())["passed"] is False


def test_prove_cli_reports_a_settings_problem(tmp_path):
    recipe = write_recipe(tmp_path / "r.json", linear_recipe())
    proc = subprocess.run(
        [sys.executable, "-m", "minifield.cli", "prove", str(recipe), "--input-root"]
        + [str(REPO / "data"), "--work-dir", str(tmp_path / "w"), "--steps", "6"]
        + ["--fail-after-step", "7", "--out", str(tmp_path / "proof.json")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 1
    proof = json.loads((tmp_path / "proof.json").read_text())
    assert proof["passed"] is False and "below steps=6" in proof["diagnosis"]
    jsonschema.validate(proof, load_schema("proof.schema.json"))
