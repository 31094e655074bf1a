"""The worker through real subprocesses: listing, validation, runs, kills, resumes."""

import json
import shlex
import shutil
import signal
import subprocess
from pathlib import Path

import pytest
from conftest import linear_recipe, read_events, run_worker, worker_command, write_recipe

pytestmark = pytest.mark.slow  # every test runs the worker as a process


def run_dir(out, job="linear-test", attempt="a1"):
    return out / job / attempt


def result_of(out, attempt, job="linear-test"):
    return json.loads((run_dir(out, job, attempt) / "result.json").read_text())


# One uninterrupted run of the 12-update job serves every test that compares with it or
# resumes from it (module-scoped: it was made once per test). Those tests only read it, and
# each one that writes beside it (a refused or resumed attempt in its output root) uses an
# attempt id of its own; the job's input root (the linear recipe reads no files) is shared.
@pytest.fixture(scope="module")
def space(tmp_path_factory):
    root = tmp_path_factory.mktemp("worker-cli")
    (root / "in").mkdir()
    return root


@pytest.fixture(scope="module")
def job(space):
    return write_recipe(space / "job.json", linear_recipe(limits={"max_steps": 12}))


@pytest.fixture(scope="module")
def reference(space, job):
    """An uninterrupted run of the 12-update job (attempt ``ref`` under ``space/ref``)."""
    run_worker(
        job=job,
        input_root=space / "in",
        output_root=space / "ref",
        attempt_id="ref",
        record_state_hashes=True,
        check_codes=[0],
    )
    return result_of(space / "ref", "ref")


def test_list_strategies_names_linear_momentum():
    proc = run_worker("--list-strategies", check_codes=[0])
    listed = {entry["name"]: entry for entry in json.loads(proc.stdout)}
    assert listed["linear-momentum"]["version"] == "1.0.0"
    assert listed["grpo"]["version"] == "1.0.0"
    assert all(entry["description"] for entry in listed.values())


def test_validate_only_names_all_three_mistakes(tmp_path):
    bad = linear_recipe(
        training={"momentum": 1.2, "batch_size": 65},
        inputs=[{"name": "examples", "path": "linear/examples.jsonl"}],
    )
    proc = run_worker(
        "--validate-only", job=write_recipe(tmp_path / "bad.json", bad), check_codes=[2]
    )
    verdict = json.loads(proc.stdout)
    assert verdict["valid"] is False
    assert {e["path"] for e in verdict["errors"]} == {
        "/training/momentum",
        "/training/batch_size",
        "/inputs/0/sha256",
    }


def test_validate_only_valid_recipe_reports_digest_and_strategy(job):
    verdict = json.loads(run_worker("--validate-only", job=job, check_codes=[0]).stdout)
    assert verdict["valid"] is True and len(verdict["computation_digest"]) == 64
    assert verdict["strategy"] == {"name": "linear-momentum", "version": "1.0.0"}


def test_completed_run_writes_result_events_checkpoints_and_export(space, reference):
    attempt = run_dir(space / "ref", attempt="ref")
    assert reference["status"] == "completed" and reference["steps_completed"] == 12
    assert reference["checkpoint"]["step"] == 12 and reference["error"] is None
    assert reference["metrics"]["heldout_mse"] <= 1.0
    assert reference["environment"]["backend"] == "cpu"
    events = read_events(attempt / "events.jsonl")
    assert [e["seq"] for e in events] == list(range(len(events)))
    types = [e["type"] for e in events]
    assert types[0] == "attempt_started" and types[-1] == "completed"
    for needed in ("device", "inputs_verified", "compiled", "checkpoint_committed", "evaluation"):
        assert needed in types
    updates = [e for e in events if e["type"] == "update"]
    assert [u["step"] for u in updates] == list(range(1, 13))
    assert all(u["examples"] == 8 and u["seconds"] > 0 for u in updates)
    assert all(u["learning_rate"] == 0.04 for u in updates)  # the schema's default, constant
    assert updates[-1]["state_hash"] == reference["final_state_hash"]
    committed = [e["step"] for e in events if e["type"] == "checkpoint_committed"]
    assert committed == [2, 4, 6, 8, 10, 12]
    assert (attempt / "export" / "model.json").is_file()
    # The manifest's sha256 names the committed checkpoint the result points at.
    import hashlib

    manifest = attempt / "checkpoints" / "step-00000012" / "manifest.json"
    assert reference["checkpoint"]["sha256"] == hashlib.sha256(manifest.read_bytes()).hexdigest()


def _start_stalled(space, job, out, attempt, stall_after, resume_from=None, stall_s=60):
    command = worker_command(
        job=job,
        input_root=space / "in",
        output_root=out,
        attempt_id=attempt,
        stall_after_step=stall_after,
        stall_seconds=stall_s,
        resume_from=resume_from,
    )
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    for line in proc.stdout:  # the worker echoes each event: wait for update K
        event = json.loads(line)
        if event["type"] == "update" and event["step"] == stall_after:
            break
    return proc


@pytest.fixture(scope="module")
def killed(space, job):
    """``killed(K)``: an attempt of the 12-update job SIGKILLed after update K, made once per K
    (under ``space/killed-K``): the test of that K resumes it, and the corrupt-checkpoint test
    works on a copy of the one killed after update 12 (a worker process fewer). A resume only
    reads the attempt it resumes (test_resuming_a_completed_attempt_trains_nothing)."""
    made = {}

    def kill(after: int) -> Path:
        if after not in made:
            out = space / f"killed-{after}"
            proc = _start_stalled(space, job, out, "killed", after)
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=30)
            made[after] = run_dir(out, attempt="killed")
        return made[after]

    return kill


@pytest.mark.parametrize("kill_after", [1, 5, 12])
def test_sigkill_then_resume_reaches_the_reference_hash(
    tmp_path, space, job, reference, killed, kill_after
):
    """Killed after update K (before that step's checkpoint, so step 1 means no checkpoint at all)."""
    out = tmp_path / "out"
    attempt = killed(kill_after)
    assert not (attempt / "result.json").exists()
    run_worker(
        job=job,
        input_root=space / "in",
        output_root=out,
        attempt_id="resumed",
        resume_from=attempt,
        check_codes=[0],
    )
    resumed = result_of(out, "resumed")
    assert resumed["final_state_hash"] == reference["final_state_hash"]
    events = read_events(run_dir(out, attempt="resumed") / "events.jsonl")
    restored = [e for e in events if e["type"] in ("restored", "restore_fallback")]
    # the stall comes before update K's own checkpoint: the last committed one is below K
    expected_step = ((kill_after - 1) // 2) * 2
    if expected_step == 0:
        assert restored[0]["type"] == "restore_fallback"
    else:
        assert restored[0]["type"] == "restored" and restored[0]["step"] == expected_step
    first_update = next(e for e in events if e["type"] == "update")
    assert first_update["step"] == expected_step + 1


def test_sigterm_commits_a_checkpoint_and_exits_3_then_resume_matches(
    tmp_path, space, job, reference
):
    out = tmp_path / "out"
    # A short stall: the signal arrives during it, and the preemption follows right after.
    proc = _start_stalled(space, job, out, "term", 3, stall_s=3)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=90) == 3
    preempted = result_of(out, "term")
    assert preempted["status"] == "preempted" and preempted["checkpoint"]["step"] == 3
    events = read_events(run_dir(out, attempt="term") / "events.jsonl")
    assert (
        events[-1]["type"] == "preempted"
        and events[-1]["checkpoint_sha256"] == preempted["checkpoint"]["sha256"]
    )
    run_worker(
        job=job,
        input_root=space / "in",
        output_root=out,
        attempt_id="after",
        resume_from=run_dir(out, attempt="term"),
        check_codes=[0],
    )
    assert result_of(out, "after")["final_state_hash"] == reference["final_state_hash"]


def test_resuming_a_completed_attempt_trains_nothing(space, job, reference):
    out = space / "ref"
    run_worker(
        job=job,
        input_root=space / "in",
        output_root=out,
        attempt_id="again",
        resume_from=run_dir(out, attempt="ref"),
        check_codes=[0],
    )
    again = result_of(out, "again")
    assert (
        again["status"] == "completed"
        and again["final_state_hash"] == reference["final_state_hash"]
    )
    events = read_events(run_dir(out, attempt="again") / "events.jsonl")
    assert not [e for e in events if e["type"] == "update"]
    # the previous attempt directory was not written to
    assert sorted(p.name for p in run_dir(out, attempt="ref").iterdir()) == [
        "attempt.json",
        "checkpoints",
        "events.jsonl",
        "export",
        "result.json",
    ]


def test_resume_with_a_recipe_of_another_digest_is_refused(tmp_path, space, job, reference):
    other = write_recipe(
        tmp_path / "other.json",
        linear_recipe(limits={"max_steps": 12}, training={"learning_rate": 0.05}),
    )
    proc = run_worker(
        job=other,
        input_root=space / "in",
        output_root=space / "ref",
        attempt_id="x",
        resume_from=run_dir(space / "ref", attempt="ref"),
        check_codes=[2],
    )
    assert "refusing to resume" in proc.stderr and "computation" in proc.stderr
    assert result_of(space / "ref", "x")["error"]["phase"] == "resume"


def test_corrupt_newest_checkpoint_falls_back_to_the_previous_good_one(
    tmp_path, space, job, reference, killed
):
    # killed after update 12, before its checkpoint: 6, 8 and 10 kept (keep 3), 10 the newest
    out = tmp_path / "out"
    shutil.copytree(killed(12), run_dir(out, attempt="k"))
    kept = {p.name for p in (run_dir(out, attempt="k") / "checkpoints").glob("step-*")}
    assert {"step-00000008", "step-00000010"} <= kept and "step-00000012" not in kept
    newest = run_dir(out, attempt="k") / "checkpoints" / "step-00000010"
    manifest = json.loads((newest / "manifest.json").read_text())
    last = manifest["arrays"][-1]  # its bytes end the data file
    target = newest / "arrays.bin"
    data = bytearray(target.read_bytes())
    data[last["offset"] + last["nbytes"] - 2] ^= 0xFF
    target.write_bytes(bytes(data))
    run_worker(
        job=job,
        input_root=space / "in",
        output_root=out,
        attempt_id="r",
        resume_from=run_dir(out, attempt="k"),
        check_codes=[0],
    )
    events = read_events(run_dir(out, attempt="r") / "events.jsonl")
    rejected = [e for e in events if e["type"] == "checkpoint_rejected"]
    assert rejected and rejected[0]["step"] == 10
    assert f"digest mismatch for state array {last['name']!r}" in rejected[0]["reason"]
    assert next(e for e in events if e["type"] == "restored")["step"] == 8
    assert result_of(out, "r")["final_state_hash"] == reference["final_state_hash"]


def test_missing_or_mismatching_input_exits_2_before_training(tmp_path):
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "ex.jsonl").write_text('{"x": 0, "y": 1}\n')
    job = write_recipe(
        tmp_path / "j.json",
        linear_recipe(inputs=[{"name": "examples", "path": "ex.jsonl", "sha256": "0" * 64}]),
    )
    proc = run_worker(
        job=job,
        input_root=tmp_path / "in",
        output_root=tmp_path / "out",
        attempt_id="a",
        check_codes=[2],
    )
    result = result_of(tmp_path / "out", "a")
    assert result["status"] == "failed" and result["error"]["phase"] == "inputs"
    assert "recipe pins" in result["error"]["message"]
    events = read_events(run_dir(tmp_path / "out", attempt="a") / "events.jsonl")
    assert not [e for e in events if e["type"] == "update"]
    assert "recipe pins" in proc.stderr


def test_reused_attempt_id_is_refused_without_touching_the_old_attempt(space, job, reference):
    before = (run_dir(space / "ref", attempt="ref") / "result.json").read_bytes()
    proc = run_worker(
        job=job,
        input_root=space / "in",
        output_root=space / "ref",
        attempt_id="ref",
        check_codes=[2],
    )
    assert "fresh attempt_id" in proc.stderr
    assert (run_dir(space / "ref", attempt="ref") / "result.json").read_bytes() == before


# A compute budget that a restart does not renew, and an environment change refused unless
# allowed (then recorded), were also tested here on the same linear job: they are now only in
# tests/test_recovery_worker.py (test_compute_budget_is_not_renewed_by_a_restart and the C/D
# parts of test_sigterm_preempts_forwarding_and_fingerprint), which check all this did (five
# worker processes fewer).


@pytest.fixture(scope="module")
def sparse_job(space, job, reference):
    """The 12-update job with a checkpoint every 5 updates, and the uninterrupted result the
    tests below compare their resumed attempts with: the module's reference run, because the
    checkpoint cadence is operational, not part of the computation (its digest is the same:
    checked here), so an uninterrupted run of it is that very run (a worker run fewer)."""
    from minifield import recipe as recipes

    sparse = write_recipe(
        space / "sparse.json",
        linear_recipe(limits={"max_steps": 12}, checkpoint={"every_steps": 5, "keep": 3}),
    )
    assert recipes.load(sparse).computation_digest == recipes.load(job).computation_digest
    return sparse, reference


def _resume_to_the_end(space, job, out, previous: str) -> dict:
    run_worker(
        job=job,
        input_root=space / "in",
        output_root=out,
        attempt_id=f"after-{previous}",
        resume_from=run_dir(out, attempt=previous),
        check_codes=[0],
    )
    return result_of(out, f"after-{previous}")


@pytest.mark.parametrize("closed", ["stdout", "stdout-and-stderr"])
def test_a_closed_stdout_preempts_with_a_checkpoint_and_resume_matches(
    tmp_path, space, sparse_job, closed
):
    """The reader of the event stream goes away mid-run (a pipe's reader ended; a supervisor
    died, taking stderr's reader too): the worker stops echoing, commits the updates made
    since its last checkpoint, writes result.json and exits 3, without a traceback."""
    job, reference = sparse_job
    out = tmp_path / "out"
    stderr_log = tmp_path / "stderr.log"
    command = worker_command(
        job=job,
        input_root=space / "in",
        output_root=out,
        attempt_id="closed",
        stall_after_step=2,
        stall_seconds=3,
    )
    with open(stderr_log, "w") as stderr_file:
        proc = subprocess.Popen(
            command,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE if closed == "stdout-and-stderr" else stderr_file,
            text=True,
        )
        for line in proc.stdout:  # read a few events live, up to update 2 (then it stalls)
            event = json.loads(line)
            if event["type"] == "update" and event["step"] == 2:
                break
        proc.stdout.close()
        if proc.stderr is not None:
            proc.stderr.close()
        code = proc.wait(timeout=120)
    assert code == 3
    attempt = run_dir(out, attempt="closed")
    result = result_of(out, "closed")
    events = read_events(attempt / "events.jsonl")
    # the events file went on after stdout closed: the update that found it closed, its
    # checkpoint (not on the every-5 cadence: made for the preemption) and the preemption
    updates = [e["step"] for e in events if e["type"] == "update"]
    stopped_at = updates[-1]
    assert updates == list(range(1, stopped_at + 1)) and 2 < stopped_at < 12
    preempted = events[-1]
    assert preempted["type"] == "preempted" and preempted["step"] == stopped_at
    assert preempted["signal"] is None and preempted["reason"].startswith("stdout closed")
    committed = [e for e in events if e["type"] == "checkpoint_committed"]
    assert committed[-1]["step"] == stopped_at
    manifest = attempt / "checkpoints" / f"step-{stopped_at:08d}" / "manifest.json"
    import hashlib

    manifest_sha = hashlib.sha256(manifest.read_bytes()).hexdigest()
    assert result["status"] == "preempted" and result["steps_completed"] == stopped_at
    assert result["checkpoint"]["step"] == stopped_at
    assert result["checkpoint"]["sha256"] == preempted["checkpoint_sha256"] == manifest_sha
    if closed == "stdout":
        stderr = stderr_log.read_text()
        assert "stdout closed" in stderr
        assert "Traceback" not in stderr and "BrokenPipeError" not in stderr
    resumed = _resume_to_the_end(space, job, out, "closed")
    assert resumed["final_state_hash"] == reference["final_state_hash"]
    resumed_events = read_events(run_dir(out, attempt="after-closed") / "events.jsonl")
    assert next(e for e in resumed_events if e["type"] == "restored")["step"] == stopped_at


def test_worker_piped_into_head_exits_3_with_a_result(tmp_path, space, sparse_job):
    """``minifield-worker ... | head -3``, as a user types it."""
    job, reference = sparse_job
    out = tmp_path / "out"
    command = shlex.join(
        worker_command(job=job, input_root=space / "in", output_root=out, attempt_id="head")
    )
    proc = subprocess.run(
        ["bash", "-c", f'{command} | head -3; echo "worker exit ${{PIPESTATUS[0]}}" >&2'],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert len(proc.stdout.splitlines()) == 3
    assert "worker exit 3" in proc.stderr, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "BrokenPipeError" not in proc.stderr
    result = result_of(out, "head")
    assert result["status"] == "preempted"
    assert result["checkpoint"]["step"] == result["steps_completed"]
    resumed = _resume_to_the_end(space, job, out, "head")
    assert resumed["final_state_hash"] == reference["final_state_hash"]
