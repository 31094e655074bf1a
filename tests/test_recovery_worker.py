"""Kill, preempt, corrupt, change: every interrupted run resumes to the reference's exact state.

All through real worker processes, parametrized over the strategies in
``recovery_cases.CASES``. Expected hashes come from an uninterrupted reference
run's own event stream, never from the code under test's summary of itself.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from checkpoint_by_hand import (
    rewrite_as_format_2,
    state_hash_by_hand,
    verify_checkpoint_by_hand,
)
from conftest import REPO, run_worker, worker_command, write_recipe
from recovery_cases import (
    CASES,
    attempt_options,
    events_of,
    run_and_kill,
    update_hashes,
    write_case_recipe,
)

KILL_SEED = int(os.environ.get("MINIFIELD_KILL_SEED", "20261130"))


@pytest.fixture(scope="module", params=CASES, ids=lambda c: c.name)
def reference(request, tmp_path_factory):
    case = request.param
    tmp = tmp_path_factory.mktemp(case.name.replace("-", "_"))
    recipe = write_case_recipe(tmp, case)
    input_root = REPO / case.input_root
    proc = subprocess.run(
        worker_command(**attempt_options(recipe, input_root, tmp / "ref", "reference")),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    ref_dir = tmp / "ref" / case.recipe()["job_id"] / "reference"
    hashes = update_hashes(ref_dir)
    assert sorted(hashes) == list(range(1, case.steps + 1))
    result = json.loads((ref_dir / "result.json").read_text())
    # the final state hash is the state after the last update, as recorded live
    assert result["final_state_hash"] == hashes[case.steps]
    return {
        "case": case,
        "tmp": tmp,
        "recipe": recipe,
        "input_root": input_root,
        "dir": ref_dir,
        "hashes": hashes,
        "final": result["final_state_hash"],
        "job": case.recipe()["job_id"],
    }


def _assert_on_reference_path(reference, attempt_dir: Path) -> None:
    """Every update of a (resumed) attempt, and its restored state, equal the reference (a
    checkpoint of the previous release restored holds a version-2 hash: its caller checks
    it by hand)."""
    events = events_of(attempt_dir)
    for event in events:
        if event["type"] == "update":
            assert event["state_hash"] == reference["hashes"][event["step"]], (
                f"{attempt_dir}: state after update {event['step']} differs from the reference"
            )
        if event["type"] == "restored" and event["step"] > 0 and event["state_hash_version"] == 3:
            assert event["state_hash"] == reference["hashes"][event["step"]]


def _manifest_sha(checkpoint_dir: Path) -> str:
    return hashlib.sha256((checkpoint_dir / "manifest.json").read_bytes()).hexdigest()


def _verify_checkpoint_by_hand(checkpoint_dir: Path) -> dict:
    return verify_checkpoint_by_hand(checkpoint_dir)[0]


def _snapshot(directory: Path) -> dict[str, str]:
    return {
        str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(directory.rglob("*"))
        if p.is_file()
    }


def _committed_step(chain_dirs: list[Path]) -> int:
    """The newest committed (manifest present) checkpoint step along a chain of attempts."""
    steps = [
        int(p.parent.name[5:])
        for d in chain_dirs
        for p in (d / "checkpoints").glob("step-*/manifest.json")
    ]
    return max(steps, default=0)


@pytest.mark.slow
def test_sigkill_at_random_points_resumes_to_the_reference(reference):
    """SIGKILL at >= 10 points: right after an update, right after a committed checkpoint
    (both chosen from the live event stream), or in the middle of a checkpoint write."""
    case, tmp = reference["case"], reference["tmp"]
    rng = random.Random(KILL_SEED)
    out = tmp / "kills"
    kills: list[dict] = []
    per_chain = 5
    chain = 0
    kinds = ["update", "during_checkpoint_write", "checkpoint_committed"]
    forced = rng.sample(kinds, len(kinds))  # every kind at least once, in random order
    while len(kills) < case.kills:
        chain_dirs: list[Path] = []
        while len(chain_dirs) < per_chain and len(kills) < case.kills:
            name = f"c{chain}-a{len(chain_dirs)}"
            start = _committed_step(chain_dirs)
            # stop short of the end, so the kill always lands before the run could complete
            span = range(start + 1, min(start + 3 * case.every, case.steps - case.every) + 1)
            if not span:  # this chain is too far along: finish it, start another
                break
            ckpt_steps = [s for s in span if s % case.every == 0]
            kind = forced.pop() if forced else rng.choice(kinds)
            if kind != "update" and not ckpt_steps:
                kind = "update"
            step = rng.choice(ckpt_steps if kind != "update" else list(span))
            extra = ["--resume-from", chain_dirs[-1]] if chain_dirs else []
            if kind == "during_checkpoint_write":
                extra += ["--kill-during-checkpoint", str(step)]

            def should_kill(event: dict, kind=kind, step=step) -> bool:
                if kind == "update":
                    return event["type"] == "update" and event["step"] == step
                if kind == "checkpoint_committed":
                    return event["type"] == "checkpoint_committed" and event["step"] == step
                return False  # the worker kills itself mid-write

            outcome = run_and_kill(
                worker_command(
                    *extra,
                    **attempt_options(reference["recipe"], reference["input_root"], out, name),
                ),
                should_kill,
            )
            attempt_dir = out / reference["job"] / name
            assert outcome["returncode"] == -signal.SIGKILL, (kind, step, outcome["returncode"])
            events = events_of(attempt_dir)
            if chain_dirs:
                restored = [e for e in events if e["type"] in ("restored", "restore_fallback")]
                assert restored[0].get("step", 0) == start
            _assert_on_reference_path(reference, attempt_dir)
            torn = sorted(p.name for p in (attempt_dir / "checkpoints").glob(".tmp-*"))
            if kind == "during_checkpoint_write":
                # arrays written, never committed: no manifest, so no resume can pick it up
                assert torn and not (attempt_dir / "checkpoints" / f"step-{step:08d}").exists()
                # the write was killed on the background writer's thread: the previous good
                # checkpoint is whole and is the reference's state (the next attempt must
                # restore it: checked above for every attempt of the chain)
                previous = _committed_step([*chain_dirs, attempt_dir])
                assert previous < step
                if previous:
                    (good,) = [
                        d / "checkpoints" / f"step-{previous:08d}"
                        for d in [*chain_dirs, attempt_dir]
                        if (d / "checkpoints" / f"step-{previous:08d}" / "manifest.json").is_file()
                    ]
                    manifest = _verify_checkpoint_by_hand(good)
                    assert manifest["state_hash"] == reference["hashes"][previous]
            kills.append({"kind": kind, "step": step, "attempt": name, "torn_checkpoint": torn})
            chain_dirs.append(attempt_dir)
        # finish the chain: resume to completion
        final = out / reference["job"] / f"c{chain}-final"
        proc = subprocess.run(
            worker_command(
                **attempt_options(reference["recipe"], reference["input_root"], out, final.name),
                resume_from=chain_dirs[-1],
            ),
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        _assert_on_reference_path(reference, final)
        result = json.loads((final / "result.json").read_text())
        assert result["final_state_hash"] == reference["final"], f"chain {chain}: {kills}"
        # the compute budget carried into each attempt is the sum of all earlier update seconds
        spent = 0.0
        for attempt_dir in [*chain_dirs, final]:
            info = json.loads((attempt_dir / "attempt.json").read_text())
            assert info["compute_seconds_before"] == pytest.approx(spent, rel=1e-9, abs=1e-12)
            spent += sum(e["seconds"] for e in events_of(attempt_dir) if e["type"] == "update")
        chain += 1
    assert len(kills) >= case.kills
    assert {k["kind"] for k in kills} == {
        "update",
        "during_checkpoint_write",
        "checkpoint_committed",
    }
    print(f"\nkill points (seed {KILL_SEED}):", json.dumps(kills))


@pytest.mark.slow
def test_sigterm_preempts_forwarding_and_fingerprint(reference, tmp_path):
    """SIGTERM (direct, then forwarded by the supervisor) → exit 3 with a committed checkpoint;
    a changed fingerprint is refused, accepted only with the override (recorded); the resumed
    chain ends on the reference's state; resuming it again trains nothing; a changed recipe
    is refused."""
    case = reference["case"]
    recipe, root, job = reference["recipe"], reference["input_root"], reference["job"]
    out = tmp_path / "out"

    # A: SIGTERM (twice) straight to the worker while it holds still after update 3, a hold
    # that ends as the signal lands (--stall-ends-on-stop, the recovery proof's): the worker
    # ends long before the hold's 120 s would
    a = subprocess.Popen(
        worker_command(
            **attempt_options(recipe, root, out, "A"),
            stall_after_step=3,
            stall_seconds=120,
            stall_ends_on_stop=True,
        ),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    for line in a.stdout:
        event = json.loads(line)
        if event["type"] == "update" and event["step"] == 3:
            a.send_signal(signal.SIGTERM)
            a.send_signal(signal.SIGTERM)
            signalled = time.monotonic()
            break
    a.stdout.read()
    assert a.wait(timeout=300) == 3, a.stderr.read()[-3000:]
    assert time.monotonic() - signalled < 60, "the hold did not end when SIGTERM arrived"
    a_dir = out / job / "A"
    preempted = [e for e in events_of(a_dir) if e["type"] == "preempted"]
    assert len(preempted) == 1 and preempted[0]["step"] == 3
    ckpt = a_dir / "checkpoints" / "step-00000003"
    assert preempted[0]["checkpoint_sha256"] == _manifest_sha(ckpt)
    assert _verify_checkpoint_by_hand(ckpt)["state_hash"] == reference["hashes"][3]
    assert json.loads((a_dir / "result.json").read_text())["status"] == "preempted"

    # B: resume under `minifield supervise`; SIGTERM the supervisor, it forwards
    run_dir = tmp_path / "run-B"
    b = subprocess.Popen(
        [sys.executable, "-m", "minifield.cli", "supervise", "--run-dir", str(run_dir)]
        + ["--deadline-s", "300", "--stall-s", "120", "--grace-s", "60", "--"]
        + worker_command(
            **attempt_options(recipe, root, out, "B"),
            resume_from=a_dir,
            stall_after_step=5,
            stall_seconds=5,
        ),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    b_dir = out / job / "B"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if (b_dir / "events.jsonl").is_file() and 5 in update_hashes(b_dir):
            break
        time.sleep(0.02)
    b.send_signal(signal.SIGTERM)
    _, err = b.communicate(timeout=300)
    assert b.returncode == 3, err[-3000:]
    run = json.loads((run_dir / "run.json").read_text())
    assert run["classification"] == "preempted" and run["exit_code"] == 3
    assert run["forwarded_signals"][0]["signal"] == "SIGTERM"
    assert [e for e in run["events"] if e["type"] == "preempted"][0]["step"] == 5
    _assert_on_reference_path(reference, b_dir)

    # C: a different environment fingerprint is refused, and nothing is lost
    changed = {
        "OMP_NUM_THREADS": "1" if os.environ.get("OMP_NUM_THREADS") != "1" else "2",
        "XLA_FLAGS": (
            os.environ.get("XLA_FLAGS", "") + " --xla_cpu_use_thunk_runtime=true"
        ).strip(),
    }
    before = _snapshot(b_dir)
    c = run_worker(
        **attempt_options(recipe, root, out, "C"),
        resume_from=b_dir,
        check_codes=[2],
        env=changed,
    )
    # (tests/test_worker_cli.py's environment-change test merged here: C and D check all it did)
    assert "the environment changed" in c.stderr and "threads" in c.stderr
    assert "xla_flags" in c.stderr and "--allow-environment-change" in c.stderr
    assert _snapshot(b_dir) == before

    # D: the explicit override resumes, is recorded, and reaches the reference's final state
    run_worker(
        **attempt_options(recipe, root, out, "D"),
        resume_from=b_dir,
        allow_environment_change=True,
        check_codes=[0],
        env=changed,
    )
    d_dir = out / job / "D"
    info = json.loads((d_dir / "attempt.json").read_text())
    assert set(info["environment_override"]) >= {"threads", "xla_flags"}
    assert info["environment_override"]["xla_flags"]["current"] == changed["XLA_FLAGS"]
    result = json.loads((d_dir / "result.json").read_text())
    assert result["environment_override"] == info["environment_override"]
    assert result["final_state_hash"] == reference["final"]
    _assert_on_reference_path(reference, d_dir)
    restored = [e for e in events_of(d_dir) if e["type"] == "restored"][0]
    assert restored["step"] == 5

    # E: resuming a completed attempt trains nothing and reports the same final state
    run_worker(
        **attempt_options(recipe, root, out, "E"),
        resume_from=d_dir,
        check_codes=[0],
        env=changed,
    )
    e_events = events_of(out / job / "E")
    assert not [e for e in e_events if e["type"] == "update"]
    assert [e for e in e_events if e["type"] == "already_completed"]
    e_result = json.loads((out / job / "E" / "result.json").read_text())
    assert e_result["status"] == "completed" and e_result["final_state_hash"] == reference["final"]

    # F: a changed recipe is a new computation: refusing to resume it, nothing written into D
    before = _snapshot(d_dir)
    other = case.recipe()
    other["training"] = {**other.get("training", {}), "seed": 99}
    f = run_worker(
        job=write_recipe(tmp_path / "other.json", other),
        input_root=root,
        output_root=out,
        resume_from=d_dir,
        check_codes=[2],
        env=changed,
    )
    assert "refusing to resume" in f.stderr and "computation" in f.stderr
    assert _snapshot(d_dir) == before


@pytest.mark.slow
def test_corrupted_checkpoints_are_rejected_and_nothing_is_lost(reference, tmp_path):
    case = reference["case"]
    # keep more checkpoints; retention is operational, so the computation is the same
    recipe = write_case_recipe(tmp_path, case, checkpoint={"every_steps": case.every, "keep": 4})
    from minifield import recipe as recipes

    assert (
        recipes.load(recipe).computation_digest
        == recipes.load(reference["recipe"]).computation_digest
    )
    out, job, root = tmp_path / "out", reference["job"], reference["input_root"]
    k = 4 * case.every + 2
    run_worker(**attempt_options(recipe, root, out, "crashed"), fail_after_step=k, check_codes=[1])
    crashed = out / job / "crashed" / "checkpoints"
    steps = sorted(int(p.name[5:]) for p in crashed.glob("step-*"))
    e = case.every
    assert steps == [e, 2 * e, 3 * e, 4 * e]
    newest, second, third = (crashed / f"step-{s:08d}" for s in (4 * e, 3 * e, 2 * e))
    # flipped byte in the newest, truncated data file in the next, missing manifest in the third
    victim = newest / "arrays.bin"
    data = bytearray(victim.read_bytes())
    data[-1] ^= 0x01  # the last array's last byte (nothing follows the last array)
    victim.write_bytes(bytes(data))
    last = json.loads((newest / "manifest.json").read_text())["arrays"][-1]["name"]
    victim2 = second / "arrays.bin"
    victim2.write_bytes(victim2.read_bytes()[: len(victim2.read_bytes()) // 2])
    (third / "manifest.json").unlink()
    # the one left to restore, as the previous release wrote it: a resume crosses formats
    rewrite_as_format_2(crashed / f"step-{e:08d}")
    before = _snapshot(out / job / "crashed")

    proc = run_worker(
        **attempt_options(recipe, root, out, "resumed"),
        resume_from=out / job / "crashed",
        check_codes=[0],
    )
    events = events_of(out / job / "resumed")
    rejected = {ev["step"]: ev["reason"] for ev in events if ev["type"] == "checkpoint_rejected"}
    assert set(rejected) == {4 * e, 3 * e}
    assert f"{victim}: digest mismatch for state array {last!r}" in rejected[4 * e]
    assert f"{victim2}: truncated or extended" in rejected[3 * e]
    assert "rejected checkpoint" in proc.stderr
    restored = [ev for ev in events if ev["type"] == "restored"]
    assert [r["step"] for r in restored] == [e]  # without a manifest a checkpoint never counted
    # format 2 as the previous release wrote it: its version-2 hash, recomputed by hand; the
    # same arrays hash as the reference's step in version 3
    _, stored = verify_checkpoint_by_hand(crashed / f"step-{e:08d}")
    assert restored[0]["state_hash_version"] == 2
    assert restored[0]["state_hash"] == state_hash_by_hand(stored, 2)
    assert state_hash_by_hand(stored) == reference["hashes"][e]
    resumed_checkpoints = out / job / "resumed" / "checkpoints"
    newest_resumed = max(resumed_checkpoints.glob("step-*"))  # zero-padded: name order
    assert _verify_checkpoint_by_hand(newest_resumed)["format"] == "minifield-checkpoint/5"
    result = json.loads((out / job / "resumed" / "result.json").read_text())
    assert result["final_state_hash"] == reference["final"]
    _assert_on_reference_path(reference, out / job / "resumed")
    assert _snapshot(out / job / "crashed") == before  # the evidence is left as it was


@pytest.mark.slow
def test_compute_budget_is_not_renewed_by_a_restart(reference, tmp_path):
    """limits.max_compute_seconds counts training seconds over all attempts (raw events)."""
    case = reference["case"]
    limits = {"max_steps": case.steps, "max_compute_seconds": 1e-9}
    recipe = write_case_recipe(tmp_path, case, limits=limits)
    out, job, root = tmp_path / "out", reference["job"], reference["input_root"]
    run_worker(**attempt_options(recipe, root, out, "first"), check_codes=[4])
    first = out / job / "first"
    # the budget is checked before each update: one update is done, then it is used up
    assert sorted(update_hashes(first)) == [1]
    result = json.loads((first / "result.json").read_text())
    assert (
        result["status"] == "limit_reached" and "max_compute_seconds" in result["error"]["message"]
    )
    assert result["checkpoint"]["step"] == 1 and result["steps_completed"] == 1
    run_worker(**attempt_options(recipe, root, out, "second"), resume_from=first, check_codes=[4])
    second = out / job / "second"
    assert update_hashes(second) == {}  # the restart did not get a fresh budget
    spent = sum(e["seconds"] for e in events_of(first) if e["type"] == "update")
    info = json.loads((second / "attempt.json").read_text())
    assert info["compute_seconds_before"] == pytest.approx(spent, rel=1e-9, abs=1e-12)
    limit = [e for e in events_of(second) if e["type"] == "limit_reached"][0]
    assert limit["step"] == 1


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["gpu", "tpu"])
def test_impossible_runtime_requirement_fails_fast(reference, tmp_path, backend):
    """A recipe that names a backend this host lacks is refused, never run on the CPU (a
    tpu one: JAX is told to start the TPU alone, so it cannot fall back)."""
    import jax

    if jax.default_backend() == backend:
        pytest.skip(f"a {backend} is present: the requirement is possible here")
    from minifield.supervision import supervise

    recipe = write_case_recipe(tmp_path, reference["case"], runtime={"backend": backend})
    outcome = supervise.supervise(
        worker_command(
            **attempt_options(recipe, reference["input_root"], tmp_path / "out", "gpu-please")
        ),
        tmp_path / "run",
        supervise.Settings(deadline_s=300, stall_s=120),
    )
    assert outcome["classification"] == "failed" and outcome["exit_code"] == 1
    assert outcome["termination"]["by"] is None  # it ended by itself, not by a time bound
    result = json.loads(
        (tmp_path / "out" / reference["job"] / "gpu-please" / "result.json").read_text()
    )
    assert result["error"]["phase"] == "device"
    assert f"runtime.backend='{backend}'" in result["error"]["message"]
    assert f"runtime.backend='{backend}'" in outcome["stderr_tail"]
    assert not [e for e in outcome["events"] if e["type"] == "update"]


def test_checkpoint_step_must_increase(tmp_path):
    import jax.numpy as jnp

    from minifield.state import checkpoint

    state = {"params": {"w": jnp.ones((2,))}, "step": jnp.zeros((), jnp.int32)}
    checkpoint.save(tmp_path, state, step=4, computation_digest="d")
    for step in (4, 3):
        with pytest.raises(checkpoint.CheckpointError, match="not greater than"):
            checkpoint.save(tmp_path, state, step=step, computation_digest="d")
    assert checkpoint.committed_steps(tmp_path) == [4]
