"""The supervisor through real processes: classification, deadline, stall, reaping, forwarding."""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import REPO, linear_recipe, worker_command, write_recipe

from minifield.commands import add_supervision_arguments, supervision_settings
from minifield.supervision import supervise
from minifield.supervision.supervise import Settings

MINUTE = Settings(deadline_s=60, stall_s=60)

CHILD = r"""
import json, signal, subprocess, sys, time

mode = sys.argv[1]


def ev(kind, **fields):
    print(json.dumps({"type": kind, **fields}), flush=True)


if mode == "complete":
    ev("attempt_started")
    print("this line is not JSON", flush=True)
    print("[1, 2]", flush=True)
    ev("completed")
    sys.exit(0)
if mode == "exit0":
    ev("attempt_started")
    sys.exit(0)
if mode == "crash":
    ev("attempt_started")
    sys.exit(7)
if mode == "stall":
    # Ignores SIGTERM (as a hung process would) and has a grandchild in its group.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    g = subprocess.Popen([sys.executable, "-c",
        "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(300)"])
    ev("grandchild", pid=g.pid)
    ev("update", step=1)
    ev("update", step=2)
    time.sleep(300)
if mode == "busy":
    # As the worker does: the handler only notes the signal and the loop answers it between
    # updates (a print from the handler could land inside an update's line and spoil both).
    stop = []
    signal.signal(signal.SIGTERM, lambda signum, frame: stop.append(signum))
    step = 0
    while True:
        if stop:
            ev("preempted", signal=stop[0])
            sys.exit(3)
        step += 1
        ev("update", step=step)
        time.sleep(0.05)
if mode == "noisy":
    sys.stderr.write("x" * 300000)
    sys.stderr.flush()
    ev("completed")
    sys.exit(0)
"""


@pytest.fixture
def child(tmp_path) -> list[str]:
    path = tmp_path / "child.py"
    path.write_text(CHILD)
    return [sys.executable, str(path)]


def _gone(pid: int) -> bool:
    """True when no process (not even an unreaped zombie) has this pid."""
    return not Path(f"/proc/{pid}").exists()


def _dead(pid: int) -> bool:
    """Gone, or a zombie waiting for a parent that is not ours (a reparented grandchild)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] == "Z"


def _group_has_live_member(pgid: int) -> bool:
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except (FileNotFoundError, ProcessLookupError):
                continue
            if int(fields[2]) == pgid and fields[0] != "Z":
                return True
    return False


def test_classify_rules():
    c = supervise.classify
    assert (
        c(exit_code=0, completed_event=True, supervisor_action=None, forwarded=False)[0]
        == "completed"
    )
    assert (
        c(exit_code=0, completed_event=False, supervisor_action=None, forwarded=False)[0]
        == "failed"
    )
    assert (
        c(exit_code=1, completed_event=True, supervisor_action=None, forwarded=False)[0] == "failed"
    )
    assert (
        c(exit_code=3, completed_event=False, supervisor_action="timeout", forwarded=False)[0]
        == "timeout"
    )
    assert (
        c(exit_code=-9, completed_event=False, supervisor_action="stalled", forwarded=False)[0]
        == "stalled"
    )
    assert (
        c(exit_code=3, completed_event=False, supervisor_action=None, forwarded=True)[0]
        == "preempted"
    )
    assert (
        c(exit_code=-9, completed_event=False, supervisor_action=None, forwarded=True)[0]
        == "cancelled"
    )
    assert (
        c(exit_code=3, completed_event=False, supervisor_action=None, forwarded=False)[0]
        == "preempted"
    )
    assert (
        c(exit_code=4, completed_event=False, supervisor_action=None, forwarded=False)[0]
        == "timeout"
    )
    assert (
        c(exit_code=-9, completed_event=False, supervisor_action=None, forwarded=False)[0]
        == "cancelled"
    )
    assert (
        c(exit_code=-11, completed_event=False, supervisor_action=None, forwarded=False)[0]
        == "failed"
    )
    # the supervisor's own preemption on cue: exit 3 is a preemption, anything else is not
    assert (
        c(exit_code=3, completed_event=False, supervisor_action="preempt", forwarded=False)[0]
        == "preempted"
    )
    assert (
        c(exit_code=-9, completed_event=False, supervisor_action="preempt", forwarded=False)[0]
        == "cancelled"
    )


def test_settings_refuse_impossible_bounds_and_match_the_config_defaults():
    for bad in (
        {"deadline_s": 0},
        {"stall_s": -1},
        {"grace_s": -0.5},
        {"deadline_s": float("nan")},
    ):
        with pytest.raises(ValueError, match=next(iter(bad))):
            Settings(**bad)
    assert Settings(pass_fds=[3, 4]).pass_fds == (3, 4)
    # one source of defaults: the config schema and config.yaml say what Settings says
    import yaml

    schema = json.loads((REPO / "workflow" / "schemas" / "config.schema.json").read_text())
    train = schema["properties"]["train"]["properties"]
    qualification = schema["properties"]["qualification"]["properties"]
    config = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
    expected = {
        "train": (supervise.TRAINING, train, config["train"]),
        "qualification": (supervise.QUALIFICATION, qualification, config["qualification"]),
    }
    for section, (settings, keys, values) in expected.items():
        for key, attribute in (("deadline_seconds", "deadline_s"), ("stall_seconds", "stall_s")):
            assert keys[key]["default"] == values[key] == getattr(settings, attribute), section
    # qualification runs use train.grace_seconds
    assert train["grace_seconds"]["default"] == config["train"]["grace_seconds"]
    assert config["train"]["grace_seconds"] == supervise.QUALIFICATION.grace_s
    assert supervise.QUALIFICATION.grace_s == supervise.TRAINING.grace_s


@pytest.mark.slow
def test_completed_needs_exit_zero_and_event_and_keeps_malformed_lines(tmp_path, child):
    outcome = supervise.supervise(child + ["complete"], tmp_path / "r", MINUTE)
    assert outcome["classification"] == "completed"
    assert [e["type"] for e in outcome["events"]] == ["attempt_started", "completed"]
    assert outcome["malformed_lines"] == [
        {"line": 2, "text": "this line is not JSON"},
        {"line": 3, "text": "[1, 2]"},
    ]
    # run.json holds exactly the returned outcome
    assert json.loads((tmp_path / "r" / "run.json").read_text()) == json.loads(json.dumps(outcome))
    assert _gone(outcome["pid"])

    exit0 = supervise.supervise(child + ["exit0"], tmp_path / "e", MINUTE)
    assert exit0["classification"] == "failed" and exit0["exit_code"] == 0
    crash = supervise.supervise(child + ["crash"], tmp_path / "c", MINUTE)
    assert crash["classification"] == "failed" and crash["exit_code"] == 7


@pytest.mark.slow
def test_start_failure_is_recorded(tmp_path):
    outcome = supervise.supervise(
        [str(tmp_path / "no-such-program")], tmp_path / "r", Settings(deadline_s=5, stall_s=5)
    )
    assert outcome["classification"] == "failed"
    assert "could not start" in outcome["reason"]
    assert json.loads((tmp_path / "r" / "run.json").read_text())["classification"] == "failed"


@pytest.mark.slow
def test_stall_kills_the_whole_group_and_reaps(tmp_path, child):
    stall_s, grace_s = 2.0, 1.0
    outcome = supervise.supervise(
        child + ["stall"],
        tmp_path / "r",
        Settings(deadline_s=120, stall_s=stall_s, grace_s=grace_s),
    )
    assert outcome["classification"] == "stalled"
    # SIGTERM is ignored by the child, so only SIGKILL after the grace period ends it
    assert outcome["signal"] == "SIGKILL" and outcome["exit_code"] == -9
    term = outcome["termination"]
    assert term["sigterm_after_s"] - term["last_event_after_s"] >= stall_s
    assert term["sigkill_after_s"] - term["sigterm_after_s"] >= grace_s
    # the child's 300 s sleep never ended: the supervisor's SIGKILL (asserted above) ended it
    # events up to the stall are kept
    types = [e["type"] for e in outcome["events"]]
    assert types == ["grandchild", "update", "update"]
    grandchild = outcome["events"][0]["pid"]
    assert _gone(outcome["pid"]), "the child must be reaped (no zombie)"
    deadline = time.monotonic() + 10
    while not _dead(grandchild) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _dead(grandchild), "a group member survived"
    assert not _group_has_live_member(outcome["pgid"])


@pytest.mark.slow
def test_deadline_sends_sigterm_and_keeps_the_events(tmp_path, child):
    outcome = supervise.supervise(
        child + ["busy"], tmp_path / "r", Settings(deadline_s=1.5, stall_s=60, grace_s=20)
    )
    assert outcome["classification"] == "timeout"
    assert outcome["exit_code"] == 3  # the child's own orderly reaction to SIGTERM
    assert outcome["events"][-1]["type"] == "preempted"
    assert outcome["termination"]["sigkill_after_s"] is None
    steps = [e["step"] for e in outcome["events"] if e["type"] == "update"]
    assert steps == list(range(1, len(steps) + 1)) and steps
    assert _gone(outcome["pid"])


@pytest.mark.slow
def test_preemption_on_cue_sends_sigterm_after_that_update(tmp_path, child):
    """The supervisor itself sends SIGTERM once it has seen update 5; the child (which
    exits 3 on SIGTERM) is then classified preempted, and the record says who stopped it."""
    outcome = supervise.supervise(
        child + ["busy"], tmp_path / "r", Settings(deadline_s=60, stall_s=60, grace_s=20),
        preempt_after_step=5,
    )  # fmt: skip
    assert outcome["classification"] == "preempted" and outcome["exit_code"] == 3
    assert outcome["termination"]["by"] == "preempt" and outcome["preempt_after_step"] == 5
    assert outcome["termination"]["sigkill_after_s"] is None
    steps = [e["step"] for e in outcome["events"] if e["type"] == "update"]
    assert steps[:5] == [1, 2, 3, 4, 5]  # the cue was seen before the signal went out
    assert outcome["events"][-1] == {"type": "preempted", "signal": signal.SIGTERM}
    on_disk = json.loads((tmp_path / "r" / "run.json").read_text())
    assert on_disk["termination"]["by"] == "preempt"


@pytest.mark.slow
def test_bounded_capture(tmp_path, child):
    outcome = supervise.supervise(
        child + ["noisy"],
        tmp_path / "r",
        Settings(deadline_s=60, stall_s=60, max_log_bytes=1000, stderr_tail_bytes=500),
    )
    assert outcome["classification"] == "completed"
    assert outcome["stderr_bytes"] == 300000
    assert len(outcome["stderr_tail"]) <= 500
    kept = (tmp_path / "r" / "stderr.log").read_text()
    assert kept.startswith("x" * 1000) and "299000 more bytes not kept" in kept


@pytest.mark.slow
def test_cli_forwards_sigterm_and_exits_with_the_classification(tmp_path, child):
    run_dir = tmp_path / "r"
    proc = subprocess.Popen(
        [sys.executable, "-m", "minifield.cli", "supervise", "--run-dir", str(run_dir)]
        + ["--deadline-s", "120", "--stall-s", "60", "--grace-s", "20", "--"]
        + child
        + ["busy"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    log = run_dir / "stdout.log"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if log.is_file() and '"update"' in log.read_text():
            break
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 3, err
    run = json.loads((run_dir / "run.json").read_text())
    assert run["classification"] == "preempted"
    assert run["exit_code"] == 3
    assert [f["signal"] for f in run["forwarded_signals"]] == ["SIGTERM"]
    assert json.loads(out)["classification"] == "preempted"


@pytest.mark.slow
def test_cli_usage_errors(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "minifield.cli", "supervise", "--run-dir", str(tmp_path)]
        + ["--deadline-s", "0", "--stall-s", "5", "--", "true"],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2 and "--deadline-s must be > 0" in proc.stderr


@pytest.mark.slow
def test_injected_worker_stall_is_stalled_and_reaped(tmp_path):
    """The real worker, stalled after update 2: it ignores SIGTERM while hung, so SIGKILL."""
    recipe = write_recipe(tmp_path / "r.json", linear_recipe())
    stall_s, grace_s = 15.0, 2.0  # stall_s covers the worker's start-up (imports, compile)
    outcome = supervise.supervise(
        worker_command(
            job=recipe,
            input_root=REPO / "data",
            output_root=tmp_path / "out",
            stall_after_step=2,
            stall_seconds=300,
        ),
        tmp_path / "run",
        Settings(deadline_s=300, stall_s=stall_s, grace_s=grace_s),
    )
    assert outcome["classification"] == "stalled", outcome["reason"]
    assert outcome["signal"] == "SIGKILL"
    updates = [e["step"] for e in outcome["events"] if e["type"] == "update"]
    assert updates == [1, 2]
    assert outcome["events"][-1]["type"] == "update"
    term = outcome["termination"]
    # the stall was judged from the last event (not from the start), and SIGKILL followed
    # SIGTERM only after the grace period: the order of the supervisor's own records
    assert term["sigterm_after_s"] - term["last_event_after_s"] >= stall_s
    assert term["sigkill_after_s"] - term["sigterm_after_s"] >= grace_s
    assert _gone(outcome["pid"]) and not _group_has_live_member(outcome["pgid"])
    with pytest.raises(ProcessLookupError):
        os.killpg(outcome["pgid"], 0)


def test_supervision_flags_are_required_unless_the_command_gives_defaults(capsys):
    supervise_flags = argparse.ArgumentParser()
    add_supervision_arguments(supervise_flags)
    with pytest.raises(SystemExit):
        supervise_flags.parse_args(["--deadline-s", "30"])
    assert "--stall-s" in capsys.readouterr().err
    args = supervise_flags.parse_args(["--deadline-s", "30", "--stall-s", "5"])
    assert supervision_settings("supervise", args) == Settings(deadline_s=30.0, stall_s=5.0)

    prove_flags = argparse.ArgumentParser()
    add_supervision_arguments(prove_flags, supervise.QUALIFICATION)
    assert supervision_settings("prove", prove_flags.parse_args([])) == supervise.QUALIFICATION
    args = prove_flags.parse_args(["--grace-s", "2.5"])
    assert supervision_settings("prove", args).grace_s == 2.5
