"""When and by whom an attempt commits checkpoints: the commit cadence (``state/checkpoint.py`` is
the checkpoint format, ``checkpoint_writer.py`` the thread that writes one in the background).

The state of one process is brought to the host and written whole (format 5). A state
spread over several processes (replicated, or sharded with ``shard_params``) is never
gathered: each process writes the blocks its devices hold, a replicated array by one of
them, and process 0 commits once every part is durable (format 4,
:mod:`minifield.state.checkpoint_parts`). All processes leave once it is committed. A
checkpoint is committed on the recipe's cadence, at the last update, and whenever the
attempt stops early (preemption, a limit), unless one of that very step is committed
already: :meth:`CheckpointCadence.ensure` is that one rule.

**Asynchronous commits**: a cadence checkpoint only takes the host copy at
the step boundary; a :class:`~minifield.attempt.checkpoint_writer.BackgroundWriter` writes and
commits it while training goes on. Its ``checkpoint_committed`` event is emitted (and
``newest`` advanced) only once the commit is durable, by the loop's next
:meth:`CheckpointCadence.collect` (a hook that does not wait for the device).
:meth:`ensure` (the end of training, a preemption, a limit) waits for the write in flight
first. A failed background write fails the attempt
(:class:`~minifield.attempt.checkpoint_writer.CheckpointWriteError`, naming the path). Over
several processes each writes its own part on its thread and process 0's thread commits once
the others' parts are durable, with no collective off the main thread; the processes learn
each other's outcome at the next commit point (:meth:`CheckpointCadence.wait`, on the main
thread of every process), where a failure anywhere fails every process alike. The final and
the stopping commits are synchronous.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable
from pathlib import Path

from ..state import checkpoint, checkpoint_spread
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
        self.writer = BackgroundWriter() if asynchronous else None
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

    def fault(self, step: int):
        """The injected kill of checkpoint ``step`` (process 0, before its commit), if any."""
        kill = self.faults.before_commit(step, self.events)
        return (lambda phase: kill() if phase == "before_commit" else None) if kill else None

    def extra(self, compute_used: float) -> dict:
        return {"attempt_id": self.attempt_id, "compute_seconds": compute_used}

    def _save_parts(self, state, step: int, compute_used: float) -> CheckpointRecord:
        """A state spread over the processes: each writes its own blocks (format 4)."""
        return checkpoint_spread.save(
            self.directory,
            state,
            step=step,
            computation_digest=self.computation_digest,
            group=self.group,
            digests=self.snapshot.digests_of(state, step),  # hashed where they live
            extra=self.extra(compute_used),
            keep=self.keep,
            fault=self.fault(step),
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
        """Take the host copy of ``state`` now; write and commit it on the writer's thread.
        Over several processes: once every process's previous write is over, each takes the
        blocks it writes (:func:`_spread_write`)."""
        started = time.monotonic()
        if self.group.size > 1:
            self.wait()
            write = _spread_write(self, state, step, compute_used)
        else:
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
        for item in done if self.group.is_writer else ():
            self._report(
                item.committed,
                seconds=item.seconds,
                blocking_seconds=item.write.blocking_seconds,
                asynchronous=True,
            )

    def collect(self) -> None:
        """Report the background commits that became durable (never waits); raise a failed
        one's error (over several processes at the next :meth:`wait` instead, where every
        process learns it). The update loop calls this after every update."""
        if self.writer is not None:
            self._emit_done(self.writer.finished(raise_error=self.group.size == 1))

    def wait(self, *, together: bool = True) -> None:
        """Wait for the write in flight and report it (the end of training, a stop, a crash).

        Over several processes, ``together`` (every process at the same point) exchanges
        whether each one's write succeeded and raises a failure in every process alike;
        ``together=False`` (a failure in this process alone) waits for this process's own."""
        if self.writer is None:
            return
        if self.group.size == 1 or not together:
            self._emit_done(self.writer.wait())
            return
        error, done = "", []
        try:
            done = self.writer.wait()
        except CheckpointWriteError as exc:
            error = str(exc)
        self._emit_done(done)
        failed = [(r, text) for r, text in enumerate(self.group.gather_texts(error)) if text]
        if failed:
            raise CheckpointWriteError("; ".join(f"process {r}: {text}" for r, text in failed))

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


def _spread_write(cadence: CheckpointCadence, state, step: int, compute_used: float) -> Write:
    """One process's share of a background checkpoint of a state spread over processes (a
    collective: every process at the same step, after :meth:`CheckpointCadence.wait`)."""
    digests = cadence.snapshot.digests_of(state, step)  # hashed where they live
    # one name per write, chosen by process 0: a killed write's leftover (its parts, its
    # descriptions) can never be taken for this one's
    group = cadence.group
    tag = group.broadcast_text(secrets.token_hex(8))
    part = checkpoint_spread.BackgroundPart(
        cadence.directory, step, rank=group.rank, count=group.size, tag=tag
    ).take(state)
    extra, fault = cadence.extra(compute_used), cadence.fault(step)
    return Write(
        step,
        lambda: part(
            computation_digest=cadence.computation_digest,
            digests=digests,
            extra=extra,
            keep=cadence.keep,
            fault=fault,
        ),
    )


def fault_hook(
    faults: Faults, checkpoints: CheckpointCadence, stop_requested: Callable[[], bool]
) -> Hook:
    """The injected fault after its update (tests and the recovery proof);
    ``stop_requested()``: whether a stop signal has arrived (a hold that ends on one)."""

    def settle(step: int) -> None:
        # which checkpoint survives the injected crash (or a kill once the update before
        # the stall is seen) must not depend on how far a background write got (a SIGKILL
        # mid-write and --kill-during-checkpoint test that): the checkpoints taken before
        # update K are committed before update K is reported
        checkpoints.wait()

    def inject(state, step: int, compute_used: float) -> None:
        faults.after_update(state, step, compute_used, stop_requested)

    return Hook(
        inject,
        due=lambda step: step in (faults.fail_after_step, faults.stall_after_step),
        settle=settle,
    )
