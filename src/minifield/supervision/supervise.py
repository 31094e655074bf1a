"""Supervise one worker process: launch, follow its events, enforce time bounds, classify.

The child is started directly from an argument list (never through a shell) in
its own session, so it and anything it might start form one process group the
supervisor can signal as a whole. stdout is read line by line: every line that
parses as a JSON object with a ``type`` is an event, anything else is kept as a
malformed line with its line number. Both streams are also written to
``stdout.log`` / ``stderr.log`` in the run directory, each capped in size.

How a run is supervised is one :class:`Settings` object (the defaults live there
only). Two time bounds end a run early: a wall-clock deadline (``timeout``) and a stall
timeout, i.e. no event for ``stall_s`` seconds (``stalled``). Either sends
SIGTERM to the group, waits ``grace_s``, sends SIGKILL, and then always waits
for the child (reaps it) and kills any group member left behind. SIGINT/SIGTERM
sent to the supervisor are forwarded to the group, so a worker commits a
checkpoint and exits ``preempted``; if it does not exit within the grace period
it is killed as well. With ``preempt_after_step=K`` the supervisor itself sends that
SIGTERM once it sees update K's event: a preemption on cue (the recovery proof uses it).

``classification`` is ``completed`` only on exit 0 **and** a ``completed``
event; otherwise ``failed``, ``timeout``, ``stalled``, ``preempted`` or
``cancelled``. ``run.json`` is written atomically with exactly the outcome the
function returns.
"""

from __future__ import annotations

import datetime as dt
import os
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from .. import atomic
from . import accelerator
from .child import CappedLog, SignalForwarder, StderrReader, StdoutReader, group_alive, signal_group

RUN_FILE = "run.json"
#: supervisor exit code per classification (0 only for ``completed``)
EXIT_CODES = {
    "completed": 0,
    "failed": 1,
    "preempted": 3,
    "timeout": 4,
    "stalled": 5,
    "cancelled": 6,
}
#: child exit codes the worker defines
WORKER_PREEMPTED, WORKER_LIMIT, WORKER_IO, WORKER_DEVICE_BUSY = 3, 4, 5, 6
#: signals that mean "someone stopped this run" rather than "it crashed"
_STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGKILL, signal.SIGHUP)
_POLL_S = 0.05


@dataclass(frozen=True)
class Settings:
    """How one child process is supervised. Every default of the project lives here.

    ``deadline_s``: wall-clock limit; ``stall_s``: longest time without an event (it counts
    from launch, so it covers start-up and compilation); ``grace_s``: SIGTERM to SIGKILL.
    ``env``/``pass_fds``: the child's environment (None: inherit) and the descriptors it
    keeps (GPU leases, the training lock). The rest bounds what is held and logged.
    """

    deadline_s: float = 86400.0
    stall_s: float = 900.0
    grace_s: float = 60.0
    env: Mapping[str, str] | None = field(default=None, repr=False)
    pass_fds: tuple[int, ...] = ()
    cwd: Path | None = None
    forward_signals: bool = True
    max_events: int = 10000
    max_malformed: int = 1000
    max_log_bytes: int = 16 << 20
    stderr_tail_bytes: int = 16384

    def __post_init__(self) -> None:
        object.__setattr__(self, "pass_fds", tuple(self.pass_fds))
        for name in ("deadline_s", "stall_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")
        if not self.grace_s >= 0:
            raise ValueError(f"grace_s must be >= 0, got {self.grace_s!r}")

    def bounds(self) -> dict[str, float]:
        """The time bounds, as recorded in run.json and proof.json."""
        return {"deadline_s": self.deadline_s, "stall_s": self.stall_s, "grace_s": self.grace_s}


#: a training attempt: the defaults above
TRAINING = Settings()
#: the qualification's runs are the recipe's first few updates: an hour is already generous
QUALIFICATION = Settings(deadline_s=3600.0)


class Companion(Protocol):
    """Something that runs beside a supervised child; neither method may raise."""

    def start(self) -> None: ...

    def finish(self) -> dict: ...


def _now_iso() -> str:
    return dt.datetime.now(dt.UTC).isoformat(timespec="milliseconds")


def classify(
    *,
    exit_code: int | None,
    completed_event: bool,
    supervisor_action: str | None,
    forwarded: bool,
) -> tuple[str, str]:
    """(classification, reason) from what was observed. Pure, so every rule is testable."""
    if exit_code == 0 and completed_event:
        return "completed", "exit 0 with a completed event"
    if supervisor_action == "timeout":
        return "timeout", "the wall-clock deadline was reached; the supervisor stopped the run"
    if supervisor_action == "stalled":
        return "stalled", "no event within the stall timeout; the supervisor stopped the run"
    if supervisor_action == "preempt":
        if exit_code == WORKER_PREEMPTED:
            return "preempted", "the supervisor preempted the run on cue (checkpoint committed)"
        return (
            "cancelled",
            f"the supervisor preempted the run on cue; it ended with exit {exit_code}",
        )
    if forwarded:
        if exit_code == WORKER_PREEMPTED:
            return "preempted", "a forwarded signal preempted the run (checkpoint committed)"
        return "cancelled", f"a forwarded signal stopped the run (exit {exit_code})"
    if exit_code == 0:
        return "failed", "exit 0 without a completed event"
    if exit_code == WORKER_PREEMPTED:
        return "preempted", "the worker was preempted by a signal (checkpoint committed)"
    if exit_code == WORKER_LIMIT:
        return (
            "timeout",
            "the worker reached a limit of the recipe (deadline, budget or step limit)",
        )
    if exit_code == WORKER_IO:
        return (
            "failed",
            "the worker could not write its output (I/O failure: a full disk, a quota); "
            "its committed checkpoints are kept and a resume continues once there is room",
        )
    if exit_code == WORKER_DEVICE_BUSY:
        return (
            "failed",
            "the accelerator stayed held by another process (device_busy); nothing was trained",
        )
    if exit_code is not None and exit_code < 0:
        sig = signal.Signals(-exit_code)
        if sig in _STOP_SIGNALS:
            return "cancelled", f"the child was killed by {sig.name} from outside the supervisor"
        return "failed", f"the child died of {sig.name}"
    return "failed", f"exit {exit_code}"


@dataclass
class _Stop:
    """How a run was stopped, if it was: the supervisor's ``action`` ("timeout" | "stalled" |
    "preempt") or a forwarded signal, and when (monotonic) each signal went to the group."""

    action: str | None = None
    term_sent: float | None = None
    kill_sent: float | None = None
    forwarded_at: float | None = None

    @property
    def requested(self) -> float | None:
        return self.term_sent if self.term_sent is not None else self.forwarded_at

    def record(self, pgid: int, started, reaped, stdout: StdoutReader, leftovers, forwarded):
        """``run.json``'s ``termination``: who stopped the run, when (seconds from ``started``),
        how long from the stop to the reaping, and what of the child's group was left."""
        return {
            "by": self.action or ("forwarded_signal" if forwarded else None),
            "sigterm_after_s": None if self.term_sent is None else self.term_sent - started,
            "sigkill_after_s": None if self.kill_sent is None else self.kill_sent - started,
            "stop_to_reap_s": None if self.requested is None else reaped - self.requested,
            "last_event_after_s": stdout.last_activity - started if stdout.events_total else None,
            "group_members_left_after_reap": leftovers,
            "group_alive_at_end": group_alive(pgid),
        }


def _watch(child, stdout: StdoutReader, forwarder, settings: Settings, started_mono) -> _Stop:
    """Wait for the child to exit; SIGTERM its group at the deadline, a stall or the preemption
    cue, and SIGKILL it a grace period after any stop (its own or a forwarded signal)."""
    stop, pgid = _Stop(), child.pid
    while child.poll() is None:
        now = time.monotonic()
        if forwarder.received and stop.forwarded_at is None:
            stop.forwarded_at = forwarder.received[0]["mono"]
        if stop.action is None and stop.term_sent is None and stop.forwarded_at is None:
            if now - started_mono >= settings.deadline_s:
                stop.action = "timeout"
            elif now - max(stdout.last_activity, started_mono) >= settings.stall_s:
                stop.action = "stalled"
            elif stdout.preempt_cue is not None:
                stop.action = "preempt"
            if stop.action is not None:
                stop.term_sent = now
                signal_group(pgid, signal.SIGTERM)
        requested = stop.requested
        if requested is not None and stop.kill_sent is None and now - requested >= settings.grace_s:
            stop.kill_sent = now
            signal_group(pgid, signal.SIGKILL)
        time.sleep(_POLL_S)
    return stop


def _reap(child) -> tuple[int, float, bool]:
    """The child's exit code once reaped (no zombie is left behind), when, and whether members
    of its group outlived it (they are killed)."""
    exit_code = child.wait()
    reaped = time.monotonic()
    leftovers = group_alive(child.pid)
    if leftovers:
        signal_group(child.pid, signal.SIGKILL)
        deadline = time.monotonic() + 5.0
        while group_alive(child.pid) and time.monotonic() < deadline:
            time.sleep(_POLL_S)
    return exit_code, reaped, leftovers


def _start(command: Sequence[str], settings: Settings, forwarder: SignalForwarder):
    """The child, in a session (and process group) of its own that the forwarder signals."""
    child = subprocess.Popen(
        list(map(str, command)),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
        # a worker: the platforms this process's first parent was given (accelerator.py)
        env=accelerator.worker_env(settings.env),
        cwd=settings.cwd,
        pass_fds=settings.pass_fds,
    )
    forwarder.pgid = child.pid
    for record in forwarder.received:  # a signal that arrived before the child existed
        signal_group(child.pid, getattr(signal, record["signal"]))
    return child


def _not_started(outcome: dict, run_dir: Path, program, exc: OSError, started_mono) -> dict:
    outcome.update(
        classification="failed",
        reason=f"could not start {program!r}: {exc}",
        exit_code=None,
        signal=None,
        pid=None,
        events=[],
        events_total=0,
        malformed_lines=[],
        ended=_now_iso(),
        duration_s=time.monotonic() - started_mono,
    )
    atomic.write_json(run_dir / RUN_FILE, outcome)
    return outcome


def supervise(
    command: Sequence[str],
    run_dir: Path,
    settings: Settings,
    *,
    preempt_after_step: int | None = None,
    companion: Companion | None = None,
) -> dict:
    """Run ``command`` under supervision; write and return the outcome (``run.json``).

    ``command`` is an argument list; it is never passed through a shell. With
    ``preempt_after_step=K``, the supervisor sends SIGTERM to the group as soon as it sees
    update K's event (then the grace period and SIGKILL as for any stop). A ``companion``
    (live delivery to a tracking server, :mod:`minifield.tracking.live`) is started once the
    child runs and finished after it was reaped; what it reports is ``run.json``'s
    ``companion``. It runs beside the child and can neither delay nor fail it.
    """
    if isinstance(command, str) or not command:
        raise ValueError("command must be a non-empty argument list (no shell strings)")
    accelerator.keep_off()  # the supervisor never holds what its worker needs
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    out_log = CappedLog(run_dir / "stdout.log", settings.max_log_bytes)
    err_log = CappedLog(run_dir / "stderr.log", settings.max_log_bytes)
    forwarder = SignalForwarder()
    started_iso, started_mono, started_time = _now_iso(), time.monotonic(), time.time()
    outcome: dict[str, Any] = {
        "command": list(map(str, command)),
        "run_dir": str(run_dir),
        **settings.bounds(),
        "preempt_after_step": preempt_after_step,
        "started": started_iso,
    }
    if settings.forward_signals:
        forwarder.install()
    try:
        try:
            child = _start(command, settings, forwarder)
        except OSError as exc:
            out_log.close()
            err_log.close()
            return _not_started(outcome, run_dir, command[0], exc, started_mono)
        stdout = StdoutReader(
            child.stdout, out_log, settings.max_events, settings.max_malformed, preempt_after_step
        )
        stderr = StderrReader(child.stderr, err_log, settings.stderr_tail_bytes)
        stdout.start()
        stderr.start()
        if companion is not None:
            companion.start()
        stop = _watch(child, stdout, forwarder, settings, started_mono)
        exit_code, reaped, leftovers = _reap(child)
        stdout.join(timeout=10)
        stderr.join(timeout=10)
        if companion is not None:
            outcome["companion"] = companion.finish()
    finally:
        if settings.forward_signals:
            forwarder.restore()
        out_log.close()
        err_log.close()

    classification, reason = classify(
        exit_code=exit_code,
        completed_event="completed" in stdout.types_seen,
        supervisor_action=stop.action,
        forwarded=bool(forwarder.received),
    )
    terminal = stdout.terminal
    outcome.update(
        classification=classification,
        reason=reason,
        exit_code=exit_code,
        signal=signal.Signals(-exit_code).name if exit_code < 0 else None,
        pid=child.pid,
        pgid=child.pid,  # start_new_session: the child leads its own group
        worker_status=terminal["type"] if terminal else None,
        worker_message=(terminal.get("message") or terminal.get("reason")) if terminal else None,
        completed_event="completed" in stdout.types_seen,
        termination=stop.record(
            child.pid, started_mono, reaped, stdout, leftovers, bool(forwarder.received)
        ),
        forwarded_signals=[
            {"signal": r["signal"], "after_s": r["mono"] - started_mono} for r in forwarder.received
        ],
        events=list(stdout.events),
        events_total=stdout.events_total,
        events_dropped=stdout.events_total - len(stdout.events),
        malformed_lines=stdout.malformed,
        malformed_total=stdout.malformed_total,
        stdout_log=str(out_log.path),
        stderr_log=str(err_log.path),
        stderr_bytes=stderr.total,
        stderr_tail=stderr.text(),
        ended=_now_iso(),
        duration_s=reaped - started_mono,
        started_unix=started_time,
    )
    atomic.write_json(run_dir / RUN_FILE, outcome)
    return outcome


def exit_code_for(outcome: Mapping[str, Any]) -> int:
    return EXIT_CODES[outcome["classification"]]


def worker_command(*args: str | os.PathLike, processes: int = 1) -> list[str]:
    """``minifield-worker ARGS`` as an argument list, with this interpreter.

    With ``processes > 1``, one attempt over that many processes: the worker with
    ``--distributed`` under :mod:`minifield.supervision.launch` (srun inside a SLURM allocation, local
    processes elsewhere), which is still a single process to supervise.
    """
    import sys

    worker = [sys.executable, "-m", "minifield.worker", *map(str, args)]
    if processes == 1:
        return worker
    launcher = [
        sys.executable,
        "-m",
        "minifield.supervision.launch",
        "--processes",
        str(processes),
        "--",
    ]
    return [*launcher, *worker, "--distributed"]
