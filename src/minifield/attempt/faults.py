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

#: how often a stall that ends on a stop signal looks for one
_STALL_POLL_S = 0.02


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
    #: the stall ends early once a stop signal has arrived: a hold that only keeps the worker
    #: from going on before the supervisor's SIGTERM lands (the recovery proof's preempted
    #: run), not a hung process (which a stall test simulates: it must stay stalled)
    stall_ends_on_stop: bool = False

    def after_update(
        self, state, step: int, compute_used: float, stop_requested: Callable[[], bool] = bool
    ) -> None:
        """The update-loop hook: crash or stall after update ``step`` when asked to;
        ``stop_requested()`` says whether a stop signal has arrived."""
        if self.fail_after_step is not None and step == self.fail_after_step:
            # Hard exit without any cleanup, as a crash would: nothing after this update is saved.
            os._exit(EXIT_FAILED)
        if self.stall_after_step is not None and step == self.stall_after_step:
            ends = time.monotonic() + self.stall_seconds
            while (left := ends - time.monotonic()) > 0:
                if self.stall_ends_on_stop and stop_requested():
                    return
                time.sleep(min(left, _STALL_POLL_S) if self.stall_ends_on_stop else left)

    def before_commit(self, step: int, events) -> Callable[[], None] | None:
        """What to run between writing checkpoint ``step``'s arrays and committing it."""
        if self.kill_during_checkpoint != step:
            return None

        def kill() -> None:
            events.emit("fault_kill", durable=True, phase="checkpoint_write", step=step)
            os.kill(os.getpid(), signal.SIGKILL)

        return kill
