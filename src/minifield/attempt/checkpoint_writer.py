"""Checkpoints committed on a background thread while training goes on.

The step boundary takes the host copy of the state (:func:`~minifield.state.arrays.named_arrays`:
on a GPU a device→host copy; on the CPU backend views of the buffers, which JAX then does
not reuse for the next update); this writer writes, hashes, fsyncs, renames and prunes it
(:func:`~minifield.state.checkpoint.save`) on its own thread. One write is in flight at a time,
so commits happen in step order and at most one extra copy of the state is held; taking
the next checkpoint while the previous one is still being written waits for it.

A failed write is never dropped: it is kept and raised (as :class:`CheckpointWriteError`,
naming the path) by the next :meth:`BackgroundWriter.finished` or :meth:`~BackgroundWriter.
wait`, and nothing queued after it is written. The previous committed checkpoint is
untouched by a failed or killed write (the temporary directory is never renamed).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from ..state.checkpoint import CheckpointRecord


class CheckpointWriteError(Exception):
    """A checkpoint could not be committed (the disk filled, the directory went away, …)."""


@dataclass
class Write:
    """One checkpoint to commit: its step, and the function that commits it."""

    step: int
    commit: Callable[[], CheckpointRecord]
    #: seconds the update loop was held up taking it (the host copy, a previous write)
    blocking_seconds: float = 0.0
    submitted: float = field(default_factory=time.monotonic)


@dataclass(frozen=True)
class Done:
    write: Write
    committed: CheckpointRecord
    #: from the write's submission until it was durable
    seconds: float


class BackgroundWriter:
    def __init__(self) -> None:
        self._lock = threading.Condition()
        self._in_flight: Write | None = None
        self._done: list[Done] = []
        self._error: CheckpointWriteError | None = None
        self._thread: threading.Thread | None = None

    def submit(self, write: Write) -> None:
        """Start committing ``write`` once the write in flight (if any) is committed."""
        self._wait_idle()
        self._raise_error()
        with self._lock:
            self._in_flight = write
        # one short-lived thread per write: nothing lingers when the attempt ends, and a
        # process that exits (or is killed) mid-write leaves only a temporary directory
        self._thread = threading.Thread(
            target=self._run, args=(write,), name=f"checkpoint-{write.step}", daemon=True
        )
        self._thread.start()

    def _run(self, write: Write) -> None:
        try:
            committed = write.commit()
        except BaseException as exc:  # noqa: BLE001 - every failure must reach the loop
            error = CheckpointWriteError(
                f"checkpoint of step {write.step} was not committed: {type(exc).__name__}: {exc}"
            )
            error.__cause__ = exc
            with self._lock:
                self._error, self._in_flight = error, None
                self._lock.notify_all()
            return
        with self._lock:
            self._done.append(Done(write, committed, time.monotonic() - write.submitted))
            self._in_flight = None
            self._lock.notify_all()

    def _wait_idle(self) -> None:
        with self._lock:
            while self._in_flight is not None:
                self._lock.wait()

    def _raise_error(self) -> None:
        with self._lock:
            error = self._error
        if error is not None:
            raise error

    def _take_done(self) -> list[Done]:
        with self._lock:
            done, self._done = self._done, []
        return done

    def finished(self, *, raise_error: bool = True) -> list[Done]:
        """The writes committed since the last call, in step order (never waits); raises the
        error of a failed one (unless ``raise_error`` is false: it is then kept for
        :meth:`wait`)."""
        done = self._take_done()
        if not done and raise_error:
            self._raise_error()
        return done

    def wait(self) -> list[Done]:
        """Wait for the write in flight; then as :meth:`finished`."""
        self._wait_idle()
        return self.finished()
