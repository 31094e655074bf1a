"""When and by whom an attempt commits checkpoints: the commit cadence (``state/checkpoint.py`` is
the checkpoint format, ``checkpoint_writer.py`` the thread that writes one in the background).

The state of one process is brought to the host and written whole (format 3). A state
spread over several processes (replicated, or sharded with ``shard_params``) is never
gathered: each process writes the blocks its devices hold, a replicated array by one of
them, and process 0 commits once every part is durable (format 4,
:mod:`minifield.state.checkpoint_parts`). All processes leave once it is committed. A
checkpoint is committed on the recipe's cadence, at the last update, and whenever the
attempt stops early (preemption, a limit), unless one of that very step is committed
already: :meth:`CheckpointCadence.ensure` is that one rule.

**Asynchronous commits** (one process): a cadence checkpoint only takes the host copy at
the step boundary; a :class:`~minifield.attempt.checkpoint_writer.BackgroundWriter` writes and
commits it while training goes on. Its ``checkpoint_committed`` event is emitted (and
``newest`` advanced) only once the commit is durable, by the loop's next
:meth:`CheckpointCadence.collect` (a hook that does not wait for the device).
:meth:`ensure` (the end of training, a preemption, a limit) waits for the write in flight
first. A failed background write fails the attempt
(:class:`~minifield.attempt.checkpoint_writer.CheckpointWriteError`, naming the path). Over
several processes commits stay synchronous: every process waits at the commit's barrier.
"""

from __future__ import annotations

import time
from pathlib import Path

from ..state import checkpoint
from ..state.arrays import STATE_HASH_VERSION, spans_processes
from ..state.checkpoint import CheckpointRecord
from ..supervision import distributed
from .checkpoint_writer import BackgroundWriter, CheckpointWriteError, Done, Write
from .events import EventLog
from .faults import Faults
from .update_loop import Hook, HostSnapshot

__all__ = ["CheckpointWriteError", "CheckpointCadence"]


class CheckpointCadence:
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

    def _save(self, arrays: dict, step: int, compute_used: float, known: dict | None):
        return checkpoint.save(
            self.directory,
            arrays,
            step=step,
            computation_digest=self.computation_digest,
            extra={"attempt_id": self.attempt_id, "compute_seconds": compute_used},
            keep=self.keep,
            before_commit=self.faults.before_commit(step, self.events),
            known_digests=known,
        )

    def _report(self, committed: CheckpointRecord, **timing) -> None:
        self.events.emit(
            "checkpoint_committed",
            durable=True,
            step=committed.step,
            path=committed.path,
            sha256=committed.sha256,
            state_hash=committed.state_hash,
            state_hash_version=STATE_HASH_VERSION,
            **timing,
        )

    def _save_parts(self, state, step: int, compute_used: float) -> CheckpointRecord:
        """A state spread over the processes: each writes its own blocks (format 4)."""
        kill = self.faults.before_commit(step, self.events)
        return checkpoint.save_parts(
            self.directory,
            state,
            step=step,
            computation_digest=self.computation_digest,
            group=self.group,
            digests=self.snapshot.digests_of(state, step),  # hashed where they live
            extra={"attempt_id": self.attempt_id, "compute_seconds": compute_used},
            keep=self.keep,
            fault=(lambda phase: kill() if phase == "before_commit" else None) if kill else None,
        )

    def commit(self, state, step: int, compute_used: float) -> CheckpointRecord:
        """Commit ``state`` as checkpoint ``step`` now (a collective over the processes)."""
        self.wait()
        started = time.monotonic()
        if spans_processes(state):
            try:
                committed = self._save_parts(state, step, compute_used)
            except (OSError, checkpoint.CheckpointError) as exc:
                raise CheckpointWriteError(
                    f"checkpoint of step {step} was not committed: {type(exc).__name__}: {exc}"
                ) from exc
            self.newest = committed
            if self.group.is_writer:
                seconds = time.monotonic() - started
                self._report(
                    committed, seconds=seconds, blocking_seconds=seconds, asynchronous=False
                )
            return self.newest
        arrays = self.snapshot.arrays_of(state, step)
        if not self.group.is_writer:
            self.newest = CheckpointRecord(step, None, None)
            self.group.barrier(f"checkpoint-{step}")
            return self.newest
        try:
            committed = self._save(arrays, step, compute_used, self.snapshot.known_digests(step))
        except (OSError, checkpoint.CheckpointError) as exc:
            raise CheckpointWriteError(
                f"checkpoint of step {step} was not committed: {type(exc).__name__}: {exc}"
            ) from exc
        self.group.barrier(f"checkpoint-{step}")
        seconds = time.monotonic() - started
        self.newest = committed
        self._report(committed, seconds=seconds, blocking_seconds=seconds, asynchronous=False)
        return self.newest

    def commit_in_background(self, state, step: int, compute_used: float) -> None:
        """Take the host copy of ``state`` now; write and commit it on the writer's thread."""
        started = time.monotonic()
        self.collect()
        arrays = self.snapshot.arrays_of(state, step)
        known = self.snapshot.known_digests(step)
        write = Write(step, lambda: self._save(arrays, step, compute_used, known))
        self.writer.submit(write)  # waits for a write still in flight
        write.blocking_seconds = time.monotonic() - started

    def _emit_done(self, done: list[Done]) -> None:
        if done:
            # durable is durable: ``newest`` (what result.json names) takes every finished
            # write before its event is tried, so an event the events file refuses (full, at
            # its size limit) loses no commit
            self.newest = done[-1].committed
        for item in done:
            self._report(
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

    def hooks(self) -> tuple[Hook, Hook]:
        """The update-loop hooks: commit on the cadence (waiting for the update's state), and
        report the background commits that became durable after every update (not waiting:
        run it after the other hooks, so that it collects what they started)."""
        return (
            Hook(self.on_cadence, due=self.due),
            Hook(lambda state, step, compute_used: self.collect(), waits=False),
        )


def fault_hook(faults: Faults, checkpoints: CheckpointCadence) -> Hook:
    """The injected fault after its update (tests and the recovery proof)."""

    def settle(step: int) -> None:
        # which checkpoint survives the injected crash (or a kill once the update before
        # the stall is seen) must not depend on how far a background write got (a SIGKILL
        # mid-write and --kill-during-checkpoint test that): the checkpoints taken before
        # update K are committed before update K is reported
        checkpoints.wait()

    return Hook(
        faults.after_update,
        due=lambda step: step in (faults.fail_after_step, faults.stall_after_step),
        settle=settle,
    )
