"""The recovery proof and the qualification gate, through a real Snakemake run of the demo."""

from __future__ import annotations

import copy
import hashlib
import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import jsonschema
import pytest
import yaml
from checkpoint_by_hand import verify_checkpoint_by_hand
from conftest import REPO, copy_run, linear_recipe, run_snakemake, write_recipe

from minifield.pipeline import errors, training
from minifield.proof.comparison import compare, divergence_text
from minifield.proof.document import FORMAT
from minifield.proof.verdict import verdict
from minifield.recipe import load_schema

# Real Snakemake runs and the prove CLI are slow; the verdict tests read documents only.


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


@pytest.mark.slow
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

    # the faulted process crashed right after update k, as its reaping supervisor saw; its
    # logs are kept
    faulted = proof["faulted"]
    assert faulted["exit_code"] == 1 and faulted["classification"] == "failed"
    supervised = json.loads((workdir / faulted["run_json"]).read_text())
    assert supervised["exit_code"] == 1 and supervised["signal"] is None
    assert faulted["exited"] is True
    assert faulted["last_update_step"] == k
    assert f"update {k}/" in (workdir / faulted["stderr_log"]).read_text()
    # (the stdout log is the worker's event stream, as the supervisor captured it)
    stdout_updates = [
        e["step"] for e in _events(workdir / faulted["stdout_log"]) if e["type"] == "update"
    ]
    assert stdout_updates == list(range(1, k + 1))

    # checkpoint used: the newest committed one, at or before k, verified by hand here too
    used = proof["checkpoint_used"]
    assert used["step"] == (k // every) * every and used["step"] <= k
    manifest_path = workdir / used["path"] / "manifest.json"
    assert hashlib.sha256(manifest_path.read_bytes()).hexdigest() == used["sha256"]
    manifest, _ = verify_checkpoint_by_hand(workdir / used["path"])
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

    _check_preemption_part_by_hand(proof, workdir, ref)
    assert verdict(proof, validation["computation_digest"]) == []

    # training ran only after the proof, under the supervisor
    result = json.loads((cdir / "train" / "result.json").read_text())
    assert result["status"] == "completed"
    run = json.loads((workdir / result["supervision"]["run_json"]).read_text())
    assert run["classification"] == "completed"


def _check_preemption_part_by_hand(proof: dict, workdir: Path, ref: dict[int, dict]) -> None:
    """The preemption part from the raw files: the supervisor's run record, the worker's
    events and result.json, the checkpoint's manifest, the resumed attempt's own records."""
    steps, k = proof["settings"]["steps"], proof["settings"]["preempt_after_step"]
    assert proof["settings"]["mode"] == "both" and k == proof["settings"]["fail_after_step"]
    part = proof["preempted"]
    assert part["passed"] is True
    run = json.loads((workdir / part["run"]["run_json"]).read_text())
    assert run["exit_code"] == 3 and run["classification"] == "preempted"
    assert run["termination"]["by"] == "preempt" and run["preempt_after_step"] == k
    assert run["termination"]["sigkill_after_s"] is None  # it left by itself, exit 3
    preempted_dir = workdir / part["run"]["attempt_dir"]
    events = _events(preempted_dir / "events.jsonl")
    # SIGTERM landed after update k and before update k+1
    assert [e["step"] for e in events if e["type"] == "update"] == list(range(1, k + 1))
    (receipt,) = [e for e in events if e["type"] == "preempted"]
    assert receipt["step"] == k and receipt["signal"] == "SIGTERM"
    result = json.loads((preempted_dir / "result.json").read_text())
    assert result["status"] == "preempted"
    assert result["checkpoint"] == {
        "step": k,
        "path": receipt["path"],
        "sha256": receipt["checkpoint_sha256"],
    }
    manifest_path = workdir / receipt["path"] / "manifest.json"
    assert hashlib.sha256(manifest_path.read_bytes()).hexdigest() == receipt["checkpoint_sha256"]
    assert json.loads(manifest_path.read_text())["state_hash"] == ref[k]["state_hash"]
    # the new attempt restored that very checkpoint, by its own records
    resumed_dir = workdir / part["resumed"]["attempt_dir"]
    info = json.loads((resumed_dir / "attempt.json").read_text())
    # (absolute where the pipeline ran; this project is a copy of it)
    assert info["resumed_from"].endswith("/" + part["run"]["attempt_dir"])
    resumed_events = _events(resumed_dir / "events.jsonl")
    (restored,) = [e for e in resumed_events if e["type"] == "restored"]
    assert (restored["step"], restored["path"]) == (k, receipt["path"])
    assert restored["sha256"] == receipt["checkpoint_sha256"]
    updates = {e["step"]: e for e in resumed_events if e["type"] == "update"}
    assert sorted(updates) == list(range(k + 1, steps + 1))
    for step in updates:
        assert updates[step]["state_hash"] == ref[step]["state_hash"]


@pytest.mark.slow
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
    result = compare(
        ref,
        resumed,
        restored_step=start,
        restored_state_hash=ref[start]["state_hash"],
        steps=steps,
    )
    div = result["first_divergence"]
    assert div["step"] == bad and div["parts"] == ["opt_state"] and div["what"] == "update"
    assert result["next_update"]["equal"] is True
    text = divergence_text(div, "crash")
    assert f"step {bad}" in text and "optimizer state" in text and "crash" in text

    del resumed[bad]
    div = compare(ref, resumed, restored_step=start, restored_state_hash="f" * 64, steps=steps)[
        "first_divergence"
    ]
    assert div["step"] == start and div["what"] == "restored checkpoint"


@pytest.mark.slow
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


@pytest.mark.slow
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


# -- the verdict, on real proof documents and altered copies of them ----------------------
PROOFS = REPO / "tests" / "data" / "proofs"


def _real_proof(name: str = "linear-demo-both.json") -> dict:
    """A proof `minifield prove` wrote for the linear demo: both parts (crash, preemption),
    or (legacy) one written before the preemption mode, which proved a crash only."""
    return json.loads((PROOFS / name).read_text())


def _refusal(proof: dict, *expected: str) -> list[str]:
    reasons = verdict(proof, _real_proof()["computation_digest"])
    assert reasons, "an altered proof was accepted"
    text = "\n".join(reasons)
    for fragment in expected:
        assert fragment in text, f"{fragment!r} not in:\n{text}"
    return reasons


def test_verdict_accepts_real_proofs_old_and_new():
    both, legacy = _real_proof(), _real_proof("linear-demo-crash-legacy.json")
    assert both["settings"]["mode"] == "both" and "mode" not in legacy["settings"]
    for proof in (both, legacy):
        jsonschema.validate(proof, load_schema("proof.schema.json"))
        assert verdict(proof, proof["computation_digest"]) == []


def test_verdict_refuses_a_foreign_proof():
    proof = _real_proof()
    other = "ab" * 32
    reasons = verdict(proof, other)
    assert any(f"not {other}" in r and proof["computation_digest"] in r for r in reasons)
    # documents that are not this format's proofs at all; a status field is no substitute
    for foreign in ([], "passed", {"passed": True}, {"status": "pass", "passed": True}):
        assert verdict(foreign, proof["computation_digest"])
    status_only = {k: v for k, v in proof.items() if k != "passed"} | {"status": "pass"}
    _refusal(status_only, "does not say it passed (passed=None)")


def test_verdict_refuses_one_altered_resumed_hash():
    for section in ("crash", "preempt"):
        proof = _real_proof()
        part = proof if section == "crash" else proof["preempted"]
        row = part["resumed"]["state_hashes"][-1]
        row["state_hash"] = "0" * 64  # only the raw record: comparison rows and flags untouched
        _refusal(
            proof,
            f"{section}: the resumed run's state hash differs from the reference's (or is "
            f"missing) at step(s) {row['step']}",
            "which its own records above contradict",
        )
    # a comparison row whose two hashes differ, its `equal` flag still true
    proof = _real_proof()
    proof["comparison"][2]["resumed"] = "1" * 64
    _refusal(proof, f"crash: the recorded comparison is not equal (or not the reference's hash) "
                    f"at step(s) {proof['comparison'][2]['step']}")  # fmt: skip


def test_verdict_refuses_comparisons_on_updates_without_hashes():
    """A proof whose runs hashed only every other update cannot claim the updates between."""
    proof = _real_proof()
    proof["settings"]["state_hash_every"] = 2
    for record in (proof["reference"], proof["resumed"]):
        record["state_hashes"] = [
            {"step": r["step"], "state_hash": r["state_hash"] if r["step"] % 2 == 0 else None}
            for r in record["state_hashes"]
        ]
    odd = [r["step"] for r in proof["comparison"] if r["step"] % 2 and r["what"] == "update"]
    for row in proof["comparison"]:
        if row["step"] in odd:
            row["reference"] = row["resumed"] = None  # claimed, and flagged equal, unhashed
            row["equal"] = True
    _refusal(
        proof,
        "recorded state hashes at cadence 2, not after every update",
        f"crash: the recorded comparison claims step(s) {', '.join(map(str, odd))}, where the "
        f"reference or the resumed run recorded no state hash",
    )
    # the cadence alone is refused even with every hash present
    proof = _real_proof()
    proof["settings"]["state_hash_every"] = "checkpoint"
    _refusal(proof, "recorded state hashes at cadence 'checkpoint'")


def test_verdict_refuses_a_missing_restore_step():
    for section in ("crash", "preempt"):
        proof = _real_proof()
        part = proof if section == "crash" else proof["preempted"]
        start = part["resumed"]["restored"]["step"]
        hashes = part["resumed"]["state_hashes"]
        part["resumed"]["state_hashes"] = [r for r in hashes if r["step"] != start + 1]
        _refusal(proof, f"{section}: the resumed run records no update {start + 1}, the step "
                        f"right after the restored checkpoint (step {start})")  # fmt: skip
    proof = _real_proof()
    proof["resumed"]["restored"] = None
    _refusal(proof, "crash: the resumed run records no restored checkpoint")


def test_verdict_refuses_passed_inconsistent_with_the_records():
    proof = _real_proof()
    proof["passed"] = False  # every hash equal, but the proof itself does not pass
    assert verdict(proof, proof["computation_digest"]) == [
        f"the proof does not say it passed (passed=False): {proof['diagnosis']}"
    ]
    proof = _real_proof()
    proof["preempted"]["passed"] = False
    _refusal(proof, "preempt: the section does not say it passed (False)")
    proof = _real_proof()
    proof["first_divergence"] = {"step": 4, "what": "update", "parts": ["rng"]}
    _refusal(proof, "crash: the proof records a divergence", "contradict")


def test_verdict_refuses_another_checkpoint_of_the_preempted_step():
    """The managed-job specification's failure: the new allocation restored a different
    checkpoint of the same step than the preemption receipt names."""
    proof = _real_proof()
    restored = proof["preempted"]["resumed"]["restored"]
    restored["path"] = restored["path"].replace("/preempted/", "/reference/")
    restored["sha256"] = "2" * 64
    _refusal(proof, "preempt: the resumed run's restored checkpoint (", "not the one the receipt")
    proof = _real_proof()
    proof["preempted"]["receipt"]["step"] = 2
    _refusal(proof, "preempt: the receipt names the checkpoint of step 2, not the step 3")
    proof = _real_proof()
    proof["preempted"] = None
    _refusal(proof, "preempt: the proof's mode includes a preemption, but it has no preempted")


def test_verdict_never_raises_on_malformed_documents():
    good = _real_proof()
    digest = good["computation_digest"]
    broken = [
        {"format": FORMAT},
        {**good, "settings": "six"},
        {**good, "settings": {**good["settings"], "steps": True}},
        {**good, "reference": {"state_hashes": "abc"}},
        {**good, "resumed": {"restored": {"step": "2"}, "state_hashes": [{"step": -1}]}},
        {**good, "comparison": [None, 3, {"step": [1]}]},
        {**good, "preempted": {"run": [], "receipt": 5, "resumed": {"restored": []}}},
        {**good, "faulted": None, "checkpoint_used": None},
    ]
    for proof in broken:
        assert verdict(proof, digest), proof

    # every value anywhere in the document replaced by every JSON type: a list of reasons
    def paths(value, prefix=()):
        yield prefix
        if isinstance(value, dict | list):
            items = value.items() if isinstance(value, dict) else enumerate(value)
            for key, child in items:
                yield from paths(child, (*prefix, key))

    for path in list(paths(good))[1:]:
        for junk in (None, True, -1, 2.5, "x", [], {}, [{"step": "1"}]):
            proof = copy.deepcopy(good)
            parent = proof
            for key in path[:-1]:
                parent = parent[key]
            parent[path[-1]] = junk
            reasons = verdict(proof, digest)
            assert isinstance(reasons, list) and all(isinstance(r, str) for r in reasons)


def test_training_gate_uses_the_verdict(tmp_path):
    proof = _real_proof()
    recipe = SimpleNamespace(computation_digest=proof["computation_digest"])
    path = tmp_path / "proof.json"
    path.write_text(json.dumps(proof))
    assert training.check_proof(path, recipe)["passed"] is True
    proof["preempted"]["resumed"]["state_hashes"][0]["state_hash"] = "0" * 64
    path.write_text(json.dumps(proof))
    with pytest.raises(errors.StageError, match="preempt: the resumed run's state hash differs"):
        training.check_proof(path, recipe)
    with pytest.raises(errors.StageError, match="of computation 'e0"):
        training.check_proof(path, SimpleNamespace(computation_digest="f" * 64))
    path.write_bytes(b"\xff\xfe")
    with pytest.raises(errors.StageError, match="cannot read the recovery proof"):
        training.check_proof(path, recipe)


@pytest.mark.slow
def test_prove_cli_preempt_mode_alone(tmp_path):
    """`--mode preempt`: no crash part at all, and the verdict and the schema accept it."""
    recipe = write_recipe(
        tmp_path / "r.json",
        linear_recipe(limits={"max_steps": 6}, checkpoint={"every_steps": 2, "keep": 3}),
    )
    out = tmp_path / "proof.json"
    proc = subprocess.run(
        [sys.executable, "-m", "minifield.cli", "prove", str(recipe), "--input-root"]
        + [str(REPO / "data"), "--work-dir", str(tmp_path / "w"), "--mode", "preempt"]
        + ["--out", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    proof = json.loads(out.read_text())
    jsonschema.validate(proof, load_schema("proof.schema.json"))
    assert proof["settings"]["mode"] == "preempt" and proof["faulted"] is None
    assert proof["preempted"]["receipt"]["step"] == proof["settings"]["preempt_after_step"] == 3
    assert verdict(proof, proof["computation_digest"]) == []
    assert json.loads(proc.stdout)["preempted"]["passed"] is True
