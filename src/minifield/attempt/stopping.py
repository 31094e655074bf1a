"""Whether an attempt stops before its next update: preemption, limits, and the vote on it.

- **Preemption**: SIGTERM/SIGINT, or a reader of the event stream that went away (stdout
  closed). The current update finishes, a checkpoint is committed, the attempt exits 3.
- **Limits**: the recipe's deadline, wall-clock limit and cumulative compute budget, and
  the operational ``--stop-after-step``. A checkpoint is committed, the attempt exits 4.
- **The vote**: signals and clocks reach the processes of a multi-process attempt at
  different moments, so all of them decide together, before every update, and stop at
  the same step. A preemption anywhere outweighs a limit.
"""

from __future__ import annotations

import datetime as dt
import signal
import time
from dataclasses import dataclass
from typing import Any

from ..supervision import distributed


@dataclass(frozen=True)
class Preempt:
    reason: str
    #: the signal's name (with the process it reached, if not this one); None when no
    #: signal stopped the run (a closed stdout)
    signal: str | None


@dataclass(frozen=True)
class LimitReached:
    reason: str


Stop = Preempt | LimitReached

# what each process votes, the highest winning: a signal, then a closed stream, then a limit
_NO_STOP, _LIMIT, _STREAM_CLOSED, _SIGNAL = 0, 1, 2, 3


class Preemption:
    """SIGTERM/SIGINT or a closed stdout set a flag; the loop stops before the next update.

    Further signals while saving only set the flag again, so a second signal can never
    interrupt a checkpoint write half-way.
    """

    def __init__(self) -> None:
        self.signal: int | None = None
        self.stream_closed: str | None = None
        self._previous: dict[int, Any] = {}

    def install(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum, _frame) -> None:
        if self.signal is None:
            self.signal = signum

    def reader_gone(self, reason: str) -> None:
        """The event stream's reader went away (``EventLog``'s ``on_echo_closed``)."""
        if self.stream_closed is None:
            self.stream_closed = reason

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def _deadline(limits: dict) -> dt.datetime:
    deadline = dt.datetime.fromisoformat(limits["deadline"].replace("Z", "+00:00"))
    return deadline if deadline.tzinfo else deadline.replace(tzinfo=dt.UTC)


def limit_reason(
    limits: dict,
    *,
    stop_after_step: int | None,
    step: int,
    started_mono: float,
    compute_used: float,
) -> str | None:
    """Why the attempt must stop now for a limit, or None."""
    if stop_after_step is not None and step >= stop_after_step:
        return f"stop_after_step={stop_after_step} reached (operational step limit)"
    if limits.get("deadline") and dt.datetime.now(dt.UTC) >= _deadline(limits):
        return f"deadline {limits['deadline']} reached"
    if (
        limits.get("max_wall_seconds")
        and time.monotonic() - started_mono >= limits["max_wall_seconds"]
    ):
        return f"max_wall_seconds={limits['max_wall_seconds']} reached in this attempt"
    if limits.get("max_compute_seconds") and compute_used >= limits["max_compute_seconds"]:
        return (
            f"cumulative compute budget max_compute_seconds={limits['max_compute_seconds']} "
            f"used ({compute_used:.3f} s)"
        )
    return None


class Stopping:
    """The stop decision before each update, taken by all processes together."""

    def __init__(
        self,
        limits: dict,
        *,
        stop_after_step: int | None,
        group: distributed.Group,
        started_mono: float,
    ):
        self.limits = limits
        self.stop_after_step = stop_after_step
        self.group = group
        self.started_mono = started_mono
        self.preemption = Preemption()

    def seconds_left(self) -> float:
        """Wall-clock seconds until the deadline or ``max_wall_seconds`` (inf: no such limit)."""
        left = float("inf")
        if self.limits.get("deadline"):
            left = (_deadline(self.limits) - dt.datetime.now(dt.UTC)).total_seconds()
        if self.limits.get("max_wall_seconds"):
            used = time.monotonic() - self.started_mono
            left = min(left, self.limits["max_wall_seconds"] - used)
        return max(left, 0.0)

    def _own_vote(self, step: int, compute_used: float) -> tuple[int, str]:
        if self.preemption.signal is not None:
            return _SIGNAL, signal.Signals(self.preemption.signal).name
        if self.preemption.stream_closed is not None:
            return _STREAM_CLOSED, self.preemption.stream_closed
        reason = limit_reason(
            self.limits,
            stop_after_step=self.stop_after_step,
            step=step,
            started_mono=self.started_mono,
            compute_used=compute_used,
        )
        return (_LIMIT, reason) if reason else (_NO_STOP, "")

    def before_update(self, step: int, compute_used: float) -> Stop | None:
        """Whether this process or any other must stop before the next update (a collective)."""
        code, text = self._own_vote(step, compute_used)
        codes = self.group.gather_ints(code)
        decided = max(codes)
        if decided == _NO_STOP:
            return None
        texts = self.group.gather_texts(text)
        if code != decided:
            rank = codes.index(decided)
            text = f"{texts[rank]} (on process {rank})"
        if decided == _SIGNAL:
            return Preempt(reason=f"signal {text}", signal=text)
        if decided == _STREAM_CLOSED:
            return Preempt(reason=text, signal=None)
        return LimitReached(reason=text)
