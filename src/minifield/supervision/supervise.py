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

import collections
import datetime as dt
import json
import os
import signal
import subprocess
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from .. import atomic

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
WORKER_PREEMPTED, WORKER_LIMIT, WORKER_IO = 3, 4, 5
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


class _CappedLog:
    """A log file that stops growing at ``limit`` bytes and says how much it dropped."""

    def __init__(self, path: Path, limit: int):
        self.path = path
        self.limit = limit
        self.written = 0
        self.dropped = 0
        self._handle = open(path, "wb")

    def write(self, data: bytes) -> None:
        room = self.limit - self.written
        if room > 0:
            chunk = data[:room]
            self._handle.write(chunk)
            self._handle.flush()
            self.written += len(chunk)
        self.dropped += max(0, len(data) - max(room, 0))

    def close(self) -> None:
        if self.dropped:
            self._handle.write(f"\n[log capped: {self.dropped} more bytes not kept]\n".encode())
        self._handle.close()


class _StdoutReader(threading.Thread):
    """Parses the child's stdout into events and malformed lines (both bounded)."""

    def __init__(
        self,
        stream,
        log: _CappedLog,
        max_events: int,
        max_malformed: int,
        preempt_after_step: int | None = None,
    ):
        super().__init__(daemon=True)
        self.stream = stream
        self.log = log
        self.events: collections.deque = collections.deque(maxlen=max_events)
        self.events_total = 0
        self.malformed: list[dict] = []
        self.malformed_total = 0
        self.max_malformed = max_malformed
        self.types_seen: set[str] = set()
        self.terminal: dict | None = None  # last completed/failed/preempted/limit_reached event
        self.last_activity = time.monotonic()
        self.preempt_after_step = preempt_after_step
        self.preempt_cue: float | None = None  # when update ``preempt_after_step`` was seen

    def run(self) -> None:
        number = 0
        while True:
            line = self.stream.readline(1 << 20)
            if not line:
                break
            number += 1
            self.log.write(line)
            text = line.decode("utf-8", errors="replace").rstrip("\n")
            if not text.strip():
                continue
            try:
                value = json.loads(text)
            except ValueError:
                value = None
            if isinstance(value, dict) and isinstance(value.get("type"), str):
                self.last_activity = time.monotonic()
                self.events.append(value)
                self.events_total += 1
                self.types_seen.add(value["type"])
                if value["type"] in ("completed", "failed", "preempted", "limit_reached"):
                    self.terminal = value
                if (
                    self.preempt_cue is None
                    and value["type"] == "update"
                    and value.get("step") == self.preempt_after_step
                ):
                    self.preempt_cue = self.last_activity
            else:
                self.malformed_total += 1
                if len(self.malformed) < self.max_malformed:
                    self.malformed.append({"line": number, "text": text[:2000]})
        self.stream.close()


class _StderrReader(threading.Thread):
    def __init__(self, stream, log: _CappedLog, tail_bytes: int):
        super().__init__(daemon=True)
        self.stream = stream
        self.log = log
        self.tail: collections.deque = collections.deque()
        self.tail_size = 0
        self.tail_bytes = tail_bytes
        self.total = 0

    def run(self) -> None:
        while True:
            chunk = self.stream.read1(65536) if hasattr(self.stream, "read1") else b""
            if not chunk:
                break
            self.total += len(chunk)
            self.log.write(chunk)
            self.tail.append(chunk)
            self.tail_size += len(chunk)
            while self.tail_size - len(self.tail[0]) >= self.tail_bytes:
                self.tail_size -= len(self.tail.popleft())
        self.stream.close()

    def text(self) -> str:
        return b"".join(self.tail)[-self.tail_bytes :].decode("utf-8", errors="replace")


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _signal_group(pgid: int, sig: int) -> bool:
    try:
        os.killpg(pgid, sig)
        return True
    except ProcessLookupError:
        return False


class _Forwarder:
    """Forward SIGINT/SIGTERM received by this process to the child's group (main thread only)."""

    def __init__(self) -> None:
        self.received: list[dict] = []
        self.pgid: int | None = None
        self._previous: dict[int, Any] = {}

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum, frame) -> None:  # noqa: ARG002
        self.received.append(
            {"signal": signal.Signals(signum).name, "mono": time.monotonic(), "time": time.time()}
        )
        if self.pgid is not None:
            _signal_group(self.pgid, signum)

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


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
    if exit_code is not None and exit_code < 0:
        sig = signal.Signals(-exit_code)
        if sig in _STOP_SIGNALS:
            return "cancelled", f"the child was killed by {sig.name} from outside the supervisor"
        return "failed", f"the child died of {sig.name}"
    return "failed", f"exit {exit_code}"


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
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    out_log = _CappedLog(run_dir / "stdout.log", settings.max_log_bytes)
    err_log = _CappedLog(run_dir / "stderr.log", settings.max_log_bytes)
    forwarder = _Forwarder()
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
            child = subprocess.Popen(
                list(map(str, command)),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                start_new_session=True,
                env=dict(settings.env) if settings.env is not None else None,
                cwd=settings.cwd,
                pass_fds=settings.pass_fds,
            )
        except OSError as exc:
            out_log.close()
            err_log.close()
            outcome.update(
                classification="failed",
                reason=f"could not start {command[0]!r}: {exc}",
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
        pgid = child.pid  # start_new_session: the child leads its own group
        forwarder.pgid = pgid
        for record in forwarder.received:  # a signal that arrived before the child existed
            _signal_group(pgid, getattr(signal, record["signal"]))
        stdout = _StdoutReader(
            child.stdout,
            out_log,
            settings.max_events,
            settings.max_malformed,
            preempt_after_step,
        )
        stderr = _StderrReader(child.stderr, err_log, settings.stderr_tail_bytes)
        stdout.start()
        stderr.start()
        if companion is not None:
            companion.start()

        # "timeout" | "stalled" | "preempt" when the supervisor stops the run
        action: str | None = None
        term_sent = kill_sent = None
        forwarded_at = None
        while True:
            code = child.poll()
            if code is not None:
                break
            now = time.monotonic()
            if forwarder.received and forwarded_at is None:
                forwarded_at = forwarder.received[0]["mono"]
            if action is None and term_sent is None and forwarded_at is None:
                if now - started_mono >= settings.deadline_s:
                    action = "timeout"
                elif now - max(stdout.last_activity, started_mono) >= settings.stall_s:
                    action = "stalled"
                elif stdout.preempt_cue is not None:
                    action = "preempt"
                if action is not None:
                    term_sent = now
                    _signal_group(pgid, signal.SIGTERM)
            stop_requested = term_sent if term_sent is not None else forwarded_at
            if (
                stop_requested is not None
                and kill_sent is None
                and now - stop_requested >= settings.grace_s
            ):
                kill_sent = now
                _signal_group(pgid, signal.SIGKILL)
            time.sleep(_POLL_S)
        exit_code = child.wait()  # reaps the child: no zombie is left behind
        reaped = time.monotonic()
        # The group outlives its leader if anything else joined it: kill the rest.
        leftovers = _group_alive(pgid)
        if leftovers:
            _signal_group(pgid, signal.SIGKILL)
            deadline = time.monotonic() + 5.0
            while _group_alive(pgid) and time.monotonic() < deadline:
                time.sleep(_POLL_S)
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
        supervisor_action=action,
        forwarded=bool(forwarder.received),
    )
    stop_at = term_sent if term_sent is not None else forwarded_at
    terminal = stdout.terminal
    outcome.update(
        classification=classification,
        reason=reason,
        exit_code=exit_code,
        signal=signal.Signals(-exit_code).name if exit_code < 0 else None,
        pid=child.pid,
        pgid=pgid,
        worker_status=terminal["type"] if terminal else None,
        worker_message=(terminal.get("message") or terminal.get("reason")) if terminal else None,
        completed_event="completed" in stdout.types_seen,
        termination={
            "by": action or ("forwarded_signal" if forwarder.received else None),
            "sigterm_after_s": None if term_sent is None else term_sent - started_mono,
            "sigkill_after_s": None if kill_sent is None else kill_sent - started_mono,
            "stop_to_reap_s": None if stop_at is None else reaped - stop_at,
            "last_event_after_s": stdout.last_activity - started_mono
            if stdout.events_total
            else None,
            "group_members_left_after_reap": leftovers,
            "group_alive_at_end": _group_alive(pgid),
        },
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
