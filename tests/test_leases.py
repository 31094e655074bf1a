"""GPU leases with configured fake GPU ids and concurrent real processes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from minifield.supervision import leases, locks

# One job: lease, run a supervised child that reports the CUDA_VISIBLE_DEVICES it sees,
# and record when the lease was held (CLOCK_MONOTONIC is shared by all processes).
JOB = r"""
import json, os, sys, time
from pathlib import Path
from minifield.supervision import leases, supervise

lease_dir, out, count, gpus = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3]), sys.argv[4:]
child = [sys.executable, "-c",
    "import json, os, time; time.sleep(0.3); "
    "print(json.dumps({'type': 'completed', 'cvd': os.environ.get('CUDA_VISIBLE_DEVICES')}))"]
with leases.lease(lease_dir, gpus, count, wait_s=120, poll_s=0.02) as held:
    acquired = time.monotonic()
    outcome = supervise.supervise(child, out.with_suffix(".run"), supervise.Settings(
        deadline_s=60, stall_s=60, env=held.env(os.environ), pass_fds=held.fds))
    released = time.monotonic()
out.write_text(json.dumps({"gpus": held.gpus, "acquired": acquired, "released": released,
                           "seen": outcome["events"][0]["cvd"],
                           "classification": outcome["classification"]}))
"""

HOLD = r"""
import sys, time
from pathlib import Path
from minifield.supervision import leases, supervise
held = leases.acquire(Path(sys.argv[1]), ["0"], 1, wait_s=30)
child = [sys.executable, "-c",
    "import os, sys, time; open(sys.argv[1], 'w').write(str(os.getpid())); time.sleep(300)",
    sys.argv[2]]
if sys.argv[3] == "child":
    supervise.supervise(child, Path(sys.argv[2] + ".run"), supervise.Settings(
        deadline_s=300, stall_s=300, pass_fds=held.fds, forward_signals=False))
else:
    print("held", flush=True)
    time.sleep(300)
"""


def _jobs(tmp_path: Path, n: int, count: int, gpus: list[str]) -> list[dict]:
    script = tmp_path / "job.py"
    script.write_text(JOB)
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), str(tmp_path / "leases"), str(tmp_path / f"job{i}.json")]
            + [str(count), *gpus]
        )
        for i in range(n)
    ]
    for proc in procs:
        assert proc.wait(timeout=240) == 0
    return [json.loads((tmp_path / f"job{i}.json").read_text()) for i in range(n)]


def _assert_no_shared_slot(records: list[dict]) -> None:
    for i, a in enumerate(records):
        for b in records[i + 1 :]:
            if set(a["gpus"]) & set(b["gpus"]):
                overlap = a["acquired"] < b["released"] and b["acquired"] < a["released"]
                assert not overlap, f"jobs shared GPU(s) {set(a['gpus']) & set(b['gpus'])}"


@pytest.mark.slow
def test_concurrent_jobs_never_share_a_slot(tmp_path):
    records = _jobs(tmp_path, 6, 1, ["0", "1"])
    _assert_no_shared_slot(records)
    for record in records:
        assert record["classification"] == "completed"
        assert len(record["gpus"]) == 1 and record["seen"] == record["gpus"][0]
    assert {r["gpus"][0] for r in records} <= {"0", "1"}


@pytest.mark.slow
def test_multi_gpu_leases_are_all_or_nothing(tmp_path):
    records = _jobs(tmp_path, 4, 2, ["a", "b", "c"])
    _assert_no_shared_slot(records)
    for record in records:
        assert len(set(record["gpus"])) == 2
        assert record["seen"] == ",".join(record["gpus"])


def _try(lease_dir: Path) -> bool:
    try:
        leases.acquire(lease_dir, ["0"], 1, wait_s=0.3, poll_s=0.05).release()
    except leases.LeaseError:
        return False
    return True


@pytest.mark.slow
def test_lease_is_released_when_the_holder_is_killed(tmp_path):
    script = tmp_path / "hold.py"
    script.write_text(HOLD)
    proc = subprocess.Popen(
        [sys.executable, str(script), str(tmp_path / "leases"), str(tmp_path / "pid"), "self"],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout.readline().strip() == "held"
    assert not _try(tmp_path / "leases")
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    assert _try(tmp_path / "leases")


@pytest.mark.slow
def test_lease_outlives_a_killed_supervisor_while_its_child_runs(tmp_path):
    script = tmp_path / "hold.py"
    script.write_text(HOLD)
    pid_file = tmp_path / "pid"
    proc = subprocess.Popen(
        [sys.executable, str(script), str(tmp_path / "leases"), str(pid_file), "child"]
    )
    deadline = time.monotonic() + 60  # a hang guard only
    while not (pid_file.is_file() and pid_file.read_text()):
        assert time.monotonic() < deadline, "hang guard: the supervised child never started"
        time.sleep(0.05)
    child = int(pid_file.read_text())
    try:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        # the orphaned child still holds the inherited lock: the slot stays taken
        assert not _try(tmp_path / "leases")
    finally:
        os.kill(child, signal.SIGKILL)
    # once the child has exited (its descriptors closed), the slot is free at once
    deadline = time.monotonic() + 60  # a hang guard only
    while not _exited(child):
        assert time.monotonic() < deadline, f"hang guard: process {child} survived SIGKILL"
        time.sleep(0.05)
    assert _try(tmp_path / "leases"), "lease not released after the child ended"


def _exited(pid: int) -> bool:
    """Gone, or a zombie (an orphan whose new parent has not reaped it yet: its descriptors,
    and the lock they hold, are already closed)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] in ("Z", "X")


def test_no_gpu_is_a_no_op(tmp_path):
    assert leases.visible_gpus([]) == []
    with leases.lease(tmp_path / "leases", [], 1) as held:
        assert held.gpus == [] and held.fds == []
        assert held.env({"A": "1"}) == {"A": "1"}
    assert not (tmp_path / "leases").exists()
    assert leases.visible_gpus([0, "3"]) == ["0", "3"]
    with pytest.raises(leases.LeaseError):
        leases.acquire(tmp_path / "leases", ["0"], 2)


def test_one_training_attempt_per_computation(tmp_path):
    """While the computation's train lock is held (e.g. by an orphaned worker), a new
    attempt is refused before any worker starts."""
    from conftest import REPO, linear_recipe, write_recipe

    from minifield.pipeline import errors, training

    recipe = write_recipe(tmp_path / "r.json", linear_recipe())
    work = tmp_path / "work"
    work.mkdir()
    fd = locks.try_lock(work / "train.lock", {"pid": os.getpid(), "who": "test"})
    try:
        with pytest.raises(errors.StageError, match="still running"):
            training.train_attempt(
                recipe,
                REPO / "data",
                tmp_path / "examples",
                work,
                tmp_path / "result.json",
                tmp_path / "export",
                tmp_path / "train.log",
            )
    finally:
        os.close(fd)
    assert not (work / "runs").exists() and not (work / "attempts").exists()
