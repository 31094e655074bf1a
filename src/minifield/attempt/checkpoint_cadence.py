"""When and by whom an attempt commits checkpoints (``checkpoint.py`` is the format of one).

Every process brings the state to the host (a collective when the state is sharded over
processes); process 0 alone writes and commits it; all leave once it is committed. A
checkpoint is committed on the recipe's cadence, at the last update, and whenever the
attempt stops early (preemption, a limit), unless one of that very step is committed
already: :meth:`Checkpointing.ensure` is that one rule.

**Asynchronous commits** (one process): a cadence checkpoint only takes the host copy at
the step boundary; a :class:`~minifield.attempt.checkpoint_writer.BackgroundWriter` writes and
commits it while training goes on. Its ``checkpoint_committed`` event is emitted (and
``newest`` advanced) only once the commit is durable, by the loop's next
:meth:`Checkpointing.collect`. :meth:`ensure` (the end of training, a preemption, a
limit) waits for the write in flight first. A failed background write fails the attempt
(:class:`~minifield.attempt.checkpoint_writer.CheckpointWriteError`, naming the path). Over
several processes commits stay synchronous: every process waits at the commit's barrier.
"""

from __future__ import annotations

import time
from pathlib import Path

from ..state import checkpoint
from ..supervision import distributed
from .checkpoint_writer import BackgroundWriter, CheckpointWriteError, Done, Write
from .events import EventLog
from .faults import Faults
from .result import CheckpointRecord
from .update_loop import HostSnapshot, loop_hook

__all__ = ["CheckpointWriteError", "Checkpointing"]


class Checkpointing:
    def __init__(
        self,
        directory: Path,
        *,
        computation_digest: str,
        attempt_id: str,
        every_steps: int,
        max_steps: int,
        keep: int,
        group: distributed.Group,
        events: EventLog,
        faults: Faults,
        snapshot: HostSnapshot | None = None,
        asynchronous: bool = True,
    ):
        self.directory = directory
        self.computation_digest = computation_digest
        self.attempt_id = attempt_id
        self.every_steps = every_steps
        self.max_steps = max_steps
        self.keep = keep
        self.group = group
        self.events = events
        self.faults = faults
        self.snapshot = snapshot or HostSnapshot()
        #: the background writer (None: every commit is synchronous)
        self.writer = BackgroundWriter() if asynchronous and group.size == 1 else None
        #: the newest committed checkpoint (a restored one until this attempt commits)
        self.newest: CheckpointRecord | None = None

    def _save(self, arrays: dict, step: int, compute_used: float, known_hash: str | None):
        return checkpoint.save(
            self.directory,
            arrays,
            step=step,
            computation_digest=self.computation_digest,
            extra={"attempt_id": self.attempt_id, "compute_seconds": compute_used},
            keep=self.keep,
            before_commit=self.faults.before_commit(step, self.events),
            known_state_hash=known_hash,
        )

    def _committed(self, committed: checkpoint.Committed, **timing) -> CheckpointRecord:
        self.newest = CheckpointRecord(committed.step, str(committed.path), committed.sha256)
        self.events.emit(
            "checkpoint_committed",
            durable=True,
            step=committed.step,
            path=str(committed.path),
            sha256=committed.sha256,
            state_hash=committed.state_hash,
            **timing,
        )
        return self.newest

    def commit(self, state, step: int, compute_used: float) -> CheckpointRecord:
        """Commit ``state`` as checkpoint ``step`` now (a collective over the processes)."""
        self.wait()
        started = time.monotonic()
        arrays = self.snapshot.arrays_of(state, step)
        if not self.group.is_writer:
            self.newest = CheckpointRecord(step, None, None)
            self.group.barrier(f"checkpoint-{step}")
            return self.newest
        try:
            committed = self._save(arrays, step, compute_used, self.snapshot.known_hash(step))
        except (OSError, checkpoint.CheckpointError) as exc:
            raise CheckpointWriteError(
                f"checkpoint of step {step} was not committed: {type(exc).__name__}: {exc}"
            ) from exc
        self.group.barrier(f"checkpoint-{step}")
        seconds = time.monotonic() - started
        return self._committed(
            committed, seconds=seconds, blocking_seconds=seconds, asynchronous=False
        )

    def commit_in_background(self, state, step: int, compute_used: float) -> None:
        """Take the host copy of ``state`` now; write and commit it on the writer's thread."""
        started = time.monotonic()
        self.collect()
        arrays = self.snapshot.arrays_of(state, step)
        known_hash = self.snapshot.known_hash(step)
        write = Write(step, lambda: self._save(arrays, step, compute_used, known_hash))
        self.writer.submit(write)  # waits for a write still in flight
        write.blocking_seconds = time.monotonic() - started

    def _emit_done(self, done: list[Done]) -> None:
        for item in done:
            self._committed(
                item.committed,
                seconds=item.seconds,
                blocking_seconds=item.write.blocking_seconds,
                asynchronous=True,
            )

    def collect(self) -> None:
        """Report the background commits that became durable (never waits); raise a failed
        one's error. The update loop calls this after every update."""
        if self.writer is not None:
            self._emit_done(self.writer.finished())

    def wait(self) -> None:
        """Wait for the write in flight and report it (the end of training, a stop, a crash)."""
        if self.writer is not None:
            self._emit_done(self.writer.wait())

    def ensure(self, state, step: int, compute_used: float) -> CheckpointRecord:
        """A committed checkpoint of ``step``: the one there is (once durable), or a new one."""
        self.wait()
        if self.newest is None or self.newest.step != step:
            self.commit(state, step, compute_used)
        return self.newest

    def due(self, step: int) -> bool:
        return step % self.every_steps == 0 or step == self.max_steps

    def on_cadence(self, state, step: int, compute_used: float) -> None:
        """The update-loop hook: commit every ``every_steps`` updates and at the last one
        (in the background when there is a writer)."""
        if not self.due(step):
            return
        if self.writer is None:
            self.commit(state, step, compute_used)
        else:
            self.commit_in_background(state, step, compute_used)

    def hook(self):
        """``on_cadence`` as an update-loop hook that says when it is due."""
        return loop_hook(self.on_cadence, self.due)
