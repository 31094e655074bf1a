"""Fault injection for tests and qualification: a crash, a stall, a kill mid-checkpoint.

Faults come from the worker's command line only, never from the recipe, so they are no
part of a computation or its digest. They hook into the update loop (after an update) and
into the checkpoint commit (between writing the arrays and committing them).
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass

from .result import EXIT_FAILED


@dataclass
class Faults:
    """Fault injection for tests and qualification: never part of the recipe or its digest."""

    #: exit hard right after update K, as a crash would: nothing after it is saved
    fail_after_step: int | None = None
    #: stop (sleep, emitting nothing) right after update K, for ``stall_seconds``
    stall_after_step: int | None = None
    stall_seconds: float = 10.0
    #: SIGKILL itself in the middle of writing checkpoint K (arrays written, not committed)
    kill_during_checkpoint: int | None = None

    def after_update(self, state, step: int, compute_used: float) -> None:
        """The update-loop hook: crash or stall after update ``step`` when asked to."""
        if self.fail_after_step is not None and step == self.fail_after_step:
            # Hard exit without any cleanup, as a crash would: nothing after this update is saved.
            os._exit(EXIT_FAILED)
        if self.stall_after_step is not None and step == self.stall_after_step:
            time.sleep(self.stall_seconds)

    def before_commit(self, step: int, events) -> Callable[[], None] | None:
        """What to run between writing checkpoint ``step``'s arrays and committing it."""
        if self.kill_during_checkpoint != step:
            return None

        def kill() -> None:
            events.emit("fault_kill", durable=True, phase="checkpoint_write", step=step)
            os.kill(os.getpid(), signal.SIGKILL)

        return kill
