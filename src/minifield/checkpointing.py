"""When and by whom an attempt commits checkpoints (``checkpoint.py`` is the format of one).

Every process brings the state to the host (a collective when the state is sharded over
processes); process 0 alone writes and commits it; all leave once it is committed. A
checkpoint is committed on the recipe's cadence, at the last update, and whenever the
attempt stops early (preemption, a limit), unless one of that very step is committed
already: :meth:`Checkpointing.ensure` is that one rule.
"""

from __future__ import annotations

import time
from pathlib import Path

from . import checkpoint, distributed
from .attempt_result import CheckpointRecord
from .events import EventLog
from .faults import Faults
from .state import named_arrays


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
        #: the newest committed checkpoint (a restored one until this attempt commits)
        self.newest: CheckpointRecord | None = None

    def commit(self, state, step: int, compute_used: float) -> CheckpointRecord:
        """Commit ``state`` as checkpoint ``step`` (a collective over the processes)."""
        started = time.monotonic()
        arrays = named_arrays(state)
        if not self.group.is_writer:
            self.newest = CheckpointRecord(step, None, None)
            self.group.barrier(f"checkpoint-{step}")
            return self.newest
        committed = checkpoint.save(
            self.directory,
            arrays,
            step=step,
            computation_digest=self.computation_digest,
            extra={"attempt_id": self.attempt_id, "compute_seconds": compute_used},
            keep=self.keep,
            before_commit=self.faults.before_commit(step, self.events),
        )
        self.group.barrier(f"checkpoint-{step}")
        self.newest = CheckpointRecord(step, str(committed.path), committed.sha256)
        self.events.emit(
            "checkpoint_committed",
            durable=True,
            step=step,
            path=str(committed.path),
            sha256=committed.sha256,
            state_hash=committed.state_hash,
            seconds=time.monotonic() - started,
        )
        return self.newest

    def ensure(self, state, step: int, compute_used: float) -> CheckpointRecord:
        """A committed checkpoint of ``step``: the one there is, or a new one."""
        if self.newest is None or self.newest.step != step:
            self.commit(state, step, compute_used)
        return self.newest

    def on_cadence(self, state, step: int, compute_used: float) -> None:
        """The update-loop hook: commit every ``every_steps`` updates and at the last one."""
        if step % self.every_steps == 0 or step == self.max_steps:
            self.commit(state, step, compute_used)
