"""``minifield.supervision.launch``: N real local processes with their topology, one exit code, signals
passed on, no hang on a dead peer; srun inside a SLURM allocation (command only here; the
cluster run is in test_slurm_profile.py)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import pytest

from minifield.supervision import launch, supervise

# A child that reports its topology to a file named after its process id, then exits with
# the code given for its id (default 0).
CHILD = """
import json, os, sys
rank = os.environ.get("MINIFIELD_PROCESS_ID", "single")
with open(os.path.join(sys.argv[1], f"{rank}.json"), "w") as handle:
    json.dump({k: v for k, v in os.environ.items() if k.startswith(("MINIFIELD_", "SLURM_"))}, handle)
codes = json.loads(sys.argv[2])
sys.exit(codes.get(rank, 0))
"""


def child(tmp_path, codes: dict | None = None) -> list[str]:
    return [sys.executable, "-c", CHILD, str(tmp_path), json.dumps(codes or {})]


@pytest.mark.slow
def test_local_processes_get_one_coordinator_and_distinct_ids(tmp_path, monkeypatch):
    monkeypatch.setenv("SLURM_STEP_NUM_TASKS", "3")  # not a SLURM task when launched locally
    assert launch.launch(child(tmp_path), 3, mode="local") == 0
    seen = {int(p.stem): json.loads(p.read_text()) for p in tmp_path.glob("*.json")}
    assert sorted(seen) == [0, 1, 2]
    coordinators = {env["MINIFIELD_COORDINATOR"] for env in seen.values()}
    assert len(coordinators) == 1 and coordinators.pop().startswith("127.0.0.1:")
    for rank, env in seen.items():
        assert env["MINIFIELD_NUM_PROCESSES"] == "3" and env["MINIFIELD_PROCESS_ID"] == str(rank)
        assert "SLURM_STEP_NUM_TASKS" not in env


@pytest.mark.slow
def test_one_process_is_started_plainly(tmp_path):
    assert launch.launch(child(tmp_path), 1) == 0
    assert [p.name for p in tmp_path.glob("*.json")] == ["single.json"]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("codes", "expected"),
    [
        ({"0": 3}, 3),  # process 0 (the writer) decides
        ({"0": 3, "1": 1}, 3),
        ({"1": 4}, 4),  # process 0 succeeded, another did not
        ({}, 0),
    ],
)
def test_exit_code_is_process_0s_unless_only_another_failed(tmp_path, codes, expected):
    assert launch.launch(child(tmp_path, codes), 2, mode="local") == expected


@pytest.mark.slow
def test_a_dead_peer_does_not_leave_the_launch_hanging(tmp_path):
    # process 0 would sleep 600 s and then leave a file: the launch must end it (SIGKILL after
    # the grace period) once its peer died, not wait for it
    slept = tmp_path / "slept"
    stuck = [sys.executable, "-c", (
        "import os, sys, time\n"
        "if os.environ['MINIFIELD_PROCESS_ID'] == '1': sys.exit(7)\n"
        f"time.sleep(600); open({str(slept)!r}, 'w').close()"
    )]  # fmt: skip
    code = launch.launch(stuck, 2, mode="local", grace_s=0.5)
    assert code == 128 + signal.SIGKILL, f"process 0 was not killed (launch exit {code})"
    assert not slept.exists(), "process 0 ran its sleep out: the launch waited for it"


@pytest.mark.slow
def test_sigterm_reaches_every_process(tmp_path):
    program = (
        "import os, signal, sys, time\n"
        "rank = os.environ['MINIFIELD_PROCESS_ID']\n"
        "def stop(signum, frame):\n"
        f"    open(os.path.join({str(tmp_path)!r}, rank), 'w').write('term')\n"
        "    sys.exit(3)\n"
        "signal.signal(signal.SIGTERM, stop)\n"
        f"open(os.path.join({str(tmp_path)!r}, 'ready-' + rank), 'w').close()\n"
        "time.sleep(600)\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-m", "minifield.supervision.launch", "--processes", "2", "--mode", "local", "--",
         sys.executable, "-c", program],
    )  # fmt: skip
    deadline = time.monotonic() + 60  # a hang guard only
    while not all((tmp_path / f"ready-{r}").exists() for r in "01"):
        assert proc.poll() is None, f"the launcher exited {proc.returncode} before both started"
        assert time.monotonic() < deadline, "hang guard: the two processes never started"
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)  # the launcher alone, as a supervisor's TERM would
    assert proc.wait(timeout=60) == 3
    assert {p.name for p in tmp_path.iterdir() if not p.name.startswith("ready")} == {"0", "1"}


def test_inside_a_slurm_allocation_it_runs_srun():
    env = {"SLURM_JOB_ID": "17", "SLURM_NTASKS": "2"}
    assert launch.allocation_tasks(env) == 2
    assert launch.allocation_tasks({"SLURM_NTASKS": "2"}) is None  # no job: not inside one
    assert launch.allocation_tasks({}) is None
    assert launch.srun_command(["w", "--x"], 2) == [
        "srun", "--ntasks=2", "--kill-on-bad-exit=0", "--wait=60", "w", "--x",
    ]  # fmt: skip
    with pytest.raises(launch.LaunchError, match="SLURM allocation of at least 4 tasks"):
        launch.launch(["true"], 4, mode="slurm", env=env)


def test_cli_usage_errors(capsys):
    assert launch.main(["--processes", "0", "--", "true"]) == 2
    assert "--processes must be >= 1" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        launch.main(["--processes", "2"])


def test_worker_command_for_several_processes():
    one = supervise.worker_command("--job", "r.json")
    assert one[1:] == ["-m", "minifield.worker", "--job", "r.json"]
    two = supervise.worker_command("--job", "r.json", processes=2)
    assert two[1:6] == ["-m", "minifield.supervision.launch", "--processes", "2", "--"]
    assert two[6:] == [*one, "--distributed"]
