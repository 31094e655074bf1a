"""The update loop: ask whether to stop, update, report, run the hooks; until ``max_steps``.

Checkpointing, periodic evaluation and fault injection are hooks, each a callable
``hook(state, step, compute_used)`` run after every update in the order given. The loop
itself knows nothing of them; it ends :class:`Finished` at ``max_steps`` or
:class:`Stopped` when :class:`~minifield.stopping.Stopping` says so before an update.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from .attempt_result import Progress
from .events import EventLog
from .state import hashes
from .stopping import Stop, Stopping

Hook = Callable[[Any, int, float], None]


@dataclass(frozen=True)
class Finished:
    state: Any
    step: int
    compute_used: float


@dataclass(frozen=True)
class Stopped:
    state: Any
    step: int
    compute_used: float
    stop: Stop


def periodic_evaluation(program, events: EventLog, max_steps: int) -> Hook:
    """A hook: the DEV metrics every ``program.eval_every`` updates (the final one excepted,
    which the attempt evaluates when it completes)."""
    every = getattr(program, "eval_every", 0)

    def evaluate(state, step: int, compute_used: float) -> None:
        if every and step % every == 0 and step < max_steps:
            started = time.monotonic()
            metrics = program.evaluate(state)
            events.emit(
                "evaluation",
                step=step,
                metrics=metrics,
                seconds=time.monotonic() - started,
                final=False,
            )

    return evaluate


class UpdateLoop:
    def __init__(
        self,
        program,
        *,
        max_steps: int,
        stopping: Stopping,
        events: EventLog,
        progress: Progress,
        hooks: Sequence[Hook],
        record_state_hashes: bool,
        say: Callable[[str], None],
    ):
        self.program = program
        self.max_steps = max_steps
        self.stopping = stopping
        self.events = events
        self.progress = progress
        self.hooks = list(hooks)
        self.record_state_hashes = record_state_hashes
        self.say = say

    def run(self, state, step: int, compute_used: float) -> Finished | Stopped:
        program = self.program
        while step < self.max_steps:
            stop = self.stopping.before_update(step, compute_used)
            if stop is not None:
                return Stopped(state, step, compute_used, stop)
            started = time.monotonic()
            state, metrics = program.step(state)
            seconds = time.monotonic() - started
            step += 1
            compute_used += seconds
            self.progress.steps_completed = step
            update = {
                "step": step,
                "examples": program.examples_per_step,
                "tokens": program.tokens_per_step,
                "seconds": seconds,
                **metrics,
            }
            if self.record_state_hashes:
                # Both from one host copy: the whole-state hash, and one per part so that a
                # divergence can be named (params, opt_state, rng, step, cursor).
                update["state_hash"], update["part_hashes"] = hashes(state)
            self.events.emit("update", **update)
            self.progress.metrics["final_loss"] = metrics.get("loss")
            self.say(
                f"update {step}/{self.max_steps} loss={metrics.get('loss'):.6g} "
                f"({seconds * 1000:.1f} ms)"
            )
            for hook in self.hooks:
                hook(state, step, compute_used)
        return Finished(state, step, compute_used)
