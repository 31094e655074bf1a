"""The publish, activate and capacity rules in a real Snakemake run of the demo recipe."""

from __future__ import annotations

import csv
import hashlib
import json
import math
from pathlib import Path

import pytest
import yaml
from conftest import copy_run, read_events, run_snakemake

pytestmark = pytest.mark.slow


def write_config(workdir: Path, **sections) -> None:
    """Update sections of the scratch project's own config (a copy of the repository's)."""
    config = yaml.safe_load((workdir / "config" / "config.yaml").read_text())
    for key, value in sections.items():
        config[key] = {**config.get(key, {}), **value} if isinstance(value, dict) else value
    (workdir / "config" / "config.yaml").write_text(yaml.safe_dump(config))


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory, linear_demo_run):
    workdir = copy_run(linear_demo_run, tmp_path_factory.mktemp("publish") / "project")
    write_config(
        workdir,
        store={"dir": "store"},
        capacity={
            "arrivals_per_hour": 120,
            "workers": 1,
            "reserve_fraction": 0.25,
            "price_per_worker_hour": 2.0,
            "checkpoint_every_steps": [1, 8],
            "max_steps_factors": [2],
        },
    )
    proc = run_snakemake(workdir)
    assert proc.returncode == 0, proc.stderr[-4000:]
    (computation,) = (workdir / "results" / "computations").iterdir()
    return workdir, computation


def test_publish_rule_publishes_without_activating(pipeline):
    workdir, computation = pipeline
    publication = json.loads((computation / "publication.json").read_text())
    content_id = publication["content_id"]
    manifest_bytes = (workdir / "store" / "artifacts" / content_id / "manifest.json").read_bytes()
    manifest = json.loads(manifest_bytes)
    canonical = json.dumps(manifest, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    assert hashlib.sha256(canonical.encode()).hexdigest() == content_id
    # The export directory's .snakemake_timestamp is not part of the payload.
    assert (computation / "train" / "export" / ".snakemake_timestamp").exists()
    assert ".snakemake_timestamp" not in {item["path"] for item in manifest["payload"]}
    result = json.loads((computation / "train" / "result.json").read_text())
    assert publication["provenance"]["final_state_hash"] == result["final_state_hash"]
    assert publication["provenance"]["code_hash"] == result["environment"]["code_hash"]
    # The workflow's qualify rule makes the recovery proof part of the provenance.
    proof = computation / "qualification" / "proof.json"
    assert (
        publication["provenance"]["recovery_proof"]["sha256"]
        == hashlib.sha256(proof.read_bytes()).hexdigest()
    )
    assert publication["activated"] is False
    assert not (workdir / "store" / "active.json").exists()


def test_capacity_rule_from_the_raw_events(pipeline):
    workdir, computation = pipeline
    document = json.loads((computation / "capacity.json").read_text())
    result = json.loads((computation / "train" / "result.json").read_text())
    events = read_events(workdir / result["attempt_dir"] / "events.jsonl")  # relative to workdir
    # The job's wall seconds, update and checkpoint seconds, worked out here from raw events.
    wall = events[-1]["mono"] - events[0]["mono"]
    updates = [e["seconds"] for e in events if e["type"] == "update"]
    # a background commit holds training up only for its recorded blocking seconds
    commits = [
        e.get("blocking_seconds", e["seconds"])
        for e in events
        if e["type"] == "checkpoint_committed"
    ]
    assert len(updates) == 8 and len(commits) == 4  # 8 updates, committed at 2, 4, 6, 8
    other = wall - sum(updates) - sum(commits)
    mean_update, mean_commit = sum(updates) / 8, sum(commits) / 4

    rows = {row["scenario"]: row for row in document["rows"]}
    assert set(rows) == {"measured", "checkpoint_every_1", "checkpoint_every_8", "workload_x2"}
    assert rows["measured"]["seconds_per_job"] == pytest.approx(wall)
    assert rows["checkpoint_every_1"]["checkpoint_commits"] == 8
    assert rows["checkpoint_every_1"]["seconds_per_job"] == pytest.approx(
        other + 8 * mean_update + 8 * mean_commit
    )
    assert rows["checkpoint_every_8"]["checkpoint_commits"] == 1  # only the final step
    assert rows["checkpoint_every_8"]["seconds_per_job"] == pytest.approx(
        other + 8 * mean_update + 1 * mean_commit
    )
    assert rows["workload_x2"]["max_steps"] == 16
    assert rows["workload_x2"]["checkpoint_commits"] == 8
    assert rows["workload_x2"]["seconds_per_job"] == pytest.approx(
        other + 16 * mean_update + 8 * mean_commit
    )
    for row in document["rows"]:
        offered = row["seconds_per_job"] * 120 / 3600
        assert row["offered_worker_hours_per_hour"] == pytest.approx(offered)
        assert row["nominal_load_per_worker"] == pytest.approx(offered / 1)
        assert row["min_workers_with_reserve"] == math.ceil(offered / 0.75)
        assert row["hourly_reserved_budget"] == pytest.approx(1 * 2.0)
        assert row["active_cost_per_job"] == pytest.approx(row["seconds_per_job"] / 3600 * 2.0)
    assert document["assumptions"]["hypothetical"] is True
    assert document["measured"]["backend"] == "cpu"
    assert "Not a cloud price" in document["note"]

    with open(workdir / "results" / "capacity.csv", newline="") as handle:
        table = list(csv.DictReader(handle))
    assert [r["scenario"] for r in table] == [r["scenario"] for r in document["rows"]]
    assert all("hypothetical" in r["assumptions"] for r in table)


def test_activate_rule_refuses_a_waived_proof_then_activates_with_the_proof(pipeline):
    workdir, computation = pipeline
    # Publishing with the proof explicitly waived records the waiver; the gate refuses it.
    write_config(workdir, store={"dir": "store", "activate": True, "require_proof": False})
    proc = run_snakemake(workdir)
    assert proc.returncode != 0
    log = (workdir / "logs" / "activate" / f"{computation.name}.log").read_text()
    assert "missing provenance: recovery_proof" in log
    assert not (workdir / "store" / "active.json").exists()
    assert not (computation / "activation.json").exists()

    # Back to the default (the qualify rule's proof is required): publish reruns with the
    # proof and activation passes the gate.
    write_config(workdir, store={"dir": "store", "activate": True, "require_proof": "auto"})
    proc = run_snakemake(workdir)
    assert proc.returncode == 0, proc.stderr[-4000:]
    proof = computation / "qualification" / "proof.json"
    publication = json.loads((computation / "publication.json").read_text())
    assert (
        publication["provenance"]["recovery_proof"]["sha256"]
        == hashlib.sha256(proof.read_bytes()).hexdigest()
    )
    activation = json.loads((computation / "activation.json").read_text())
    pointer = json.loads((workdir / "store" / "active.json").read_text())
    assert activation["current"] == pointer["current"] == publication["content_id"]
    assert activation["acceptance"]["passed"] is True
