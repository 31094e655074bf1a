"""The update loop: ask whether to stop, update, report, run the hooks; until ``max_steps``.

Checkpoints on the cadence, periodic evaluation and fault injection are :class:`Hook` s:
what runs after an update (``run(state, step, compute_used)``), how often (``due(step)``)
and how it settles (``settle(step)``, before that update is reported), as Levanter's
``add_hook(fn, every=N)``.
They run in the order given. The loop itself knows nothing of them; it ends
:class:`Finished` at ``max_steps`` or :class:`Stopped` when
:class:`~minifield.attempt.stopping.Stopping` says so before an update.

**No host stalls.** An update is *dispatched* (:meth:`~minifield.strategies.base.Program.
dispatch`) and the loop goes on without waiting for the device: the metrics of update
``n`` are read back (and its ``update`` event emitted) only once update ``n + 1`` is
queued behind it, so the device never idles while the host reports. The loop waits for
update ``n`` itself only when something needs its state on the host at that step: a hook
that is due and ``waits`` for it, a state hash on the cadence, or the last update. A hook
that only collects finished work (``waits=False``) runs without making the loop wait. Events stay
complete and in step order: a pending update is reported before anything else is
emitted, and before the loop ends for any reason.

**Divergence.** An update whose metrics (loss, gradient norm, …) are not finite ends the
loop with :class:`Diverged`, raised where the metrics are read anyway (one update late, no
extra host sync), before its ``update`` event and before any hook of that step: a
checkpoint is only taken of a state whose update was seen finite.

**State-hash cadence** (:class:`HashCadence`): every update, every K updates, or at
checkpoints only (whose manifests always carry the complete-state hash).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ..state.arrays import (
    STATE_HASH_VERSION,
    array_digests,
    hash_named_arrays,
    hashes_of,
    named_arrays,
    named_leaves,
    spans_processes,
    state_digests,
)
from .events import EventLog
from .hash_cadence import HashCadence
from .result import Progress
from .stopping import Stop, Stopping


def after_every_update(step: int) -> bool:
    return True


@dataclass(frozen=True)
class Hook:
    """What the loop runs after an update, how often, and how it settles.

    ``run(state, step, compute_used)`` runs after every update ``due(step)`` accepts, in the
    order the hooks were given. ``settle(step)``, if given, runs before that update is
    reported: what must be finished before anyone reading the events sees the update.
    ``waits``: whether a due hook needs the update's state on the host (the loop then waits
    for the device); a hook that only collects finished background work does not.
    """

    run: Callable[[Any, int, float], None]
    due: Callable[[int], bool] = after_every_update
    settle: Callable[[int], None] | None = None
    waits: bool = True


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


class Diverged(Exception):  # noqa: N818 - an ending, like Finished and Stopped
    """Update ``step``'s metric ``metric`` came back ``value``, not a finite number."""

    def __init__(self, step: int, metric: str, value: float):
        super().__init__(f"update {step}: {metric} is {value} (not finite)")
        self.step, self.metric, self.value = step, metric, value


def non_finite(metrics: dict) -> tuple[str, float] | None:
    """The first metric (in name order) that is a float but not a finite one, else None."""
    for name in sorted(metrics):
        value = metrics[name]
        if isinstance(value, float) and not math.isfinite(value):
            return name, value
    return None


def check_evaluation(step: int, metrics: dict) -> None:
    """An evaluation of update ``step``'s state that is not finite (its DEV loss overflowed)
    is a divergence too, raised before its event (JSON holds no NaN) and before an export."""
    bad = non_finite(metrics)
    if bad is not None:
        raise Diverged(step, f"the evaluation's {bad[0]}", bad[1])


def evaluation(
    program, state, step: int, events: EventLog, *, final: bool, keep: dict | None = None
) -> None:
    """Evaluate update ``step``'s state, check it finite and emit its ``evaluation`` event;
    ``keep`` (the result's metrics) takes the metrics before the event is written, so a
    result still holds them when writing the event fails."""
    started = time.monotonic()
    metrics = program.evaluate(state)
    check_evaluation(step, metrics)
    if keep is not None:
        keep.update(metrics)
    events.emit(
        "evaluation",
        step=step,
        metrics=metrics,
        seconds=time.monotonic() - started,
        final=final,
    )


class HostSnapshot:
    """The state of one step copied to the host at most once: the update's state hash, a
    checkpoint and the final hash of that step share the copy, and its per-array digests
    (a checkpoint of a hashed step does not hash its pieces again). A state spread over
    several processes is hashed where it lives (no copy; only digests are exchanged)."""

    def __init__(self) -> None:
        self.step: int | None = None
        self.arrays: dict | None = None
        self.digests: dict[str, str] | None = None

    def _at(self, step: int) -> None:
        if self.step != step:
            self.step, self.arrays, self.digests = step, None, None

    def arrays_of(self, state, step: int) -> dict:
        """The named host arrays of ``state`` at ``step`` (a collective when sharded)."""
        self._at(step)
        if self.arrays is None:
            self.arrays = named_arrays(state)
        return self.arrays

    def digests_of(self, state, step: int) -> dict[str, str]:
        self._at(step)
        if self.digests is None:
            if self.arrays is None and spans_processes(state):
                self.digests = state_digests(state)
            else:
                self.digests = array_digests(self.arrays_of(state, step))
        return self.digests

    def hash_of(self, state, step: int) -> str:
        digests = self.digests_of(state, step)
        return hash_named_arrays(named_leaves(state), digests=digests)

    def hashes_of(self, state, step: int) -> tuple[str, dict[str, str]]:
        """The complete-state hash and one per state part (the update event's)."""
        digests = self.digests_of(state, step)
        return hashes_of(dict(named_leaves(state)), digests)

    def known_digests(self, step: int) -> dict[str, str] | None:
        """The per-array digests of ``step``'s state, if it was hashed."""
        return self.digests if self.step == step else None

    def forget(self) -> None:
        # the arrays may be views of device buffers: holding them blocks buffer donation
        self.step, self.arrays, self.digests = None, None, None


def periodic_evaluation(program, events: EventLog, max_steps: int) -> Hook:
    """The DEV metrics every ``program.eval_every`` updates (the final one excepted, which
    the attempt evaluates when it completes)."""
    every = getattr(program, "eval_every", 0)

    def evaluate(state, step: int, compute_used: float) -> None:
        evaluation(program, state, step, events, final=False)

    return Hook(evaluate, due=lambda step: bool(every) and step % every == 0 and step < max_steps)


@dataclass
class _Pending:
    """A dispatched update whose metrics are not read back yet."""

    step: int
    read_metrics: Callable[[], dict[str, float]]
    dispatched: float


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
        record_state_hashes: bool | int | str | HashCadence,
        say: Callable[[str], None],
        snapshot: HostSnapshot | None = None,
    ):
        self.program = program
        self.max_steps = max_steps
        self.stopping = stopping
        self.events = events
        self.progress = progress
        self.hooks = list(hooks)
        self.cadence = (
            record_state_hashes
            if isinstance(record_state_hashes, HashCadence)
            else HashCadence.parse(record_state_hashes)
        )
        self.say = say
        self.snapshot = snapshot or HostSnapshot()
        self._last_ready = time.monotonic()
        # no update measured yet: every one counts until one is
        self._longest_update = float("inf")

    def run(self, state, step: int, compute_used: float) -> Finished | Stopped:
        program = self.program
        pending: _Pending | None = None
        self._last_ready = time.monotonic()
        while step < self.max_steps:
            if pending is not None and self._near_compute_budget(compute_used):
                # the budget check must see the pending update's seconds too
                compute_used = self._report(pending, compute_used, None)
                pending = None
            stop = self.stopping.before_update(step, compute_used)
            if stop is not None:
                if pending is not None:
                    compute_used = self._report(pending, compute_used, None)
                return Stopped(state, step, compute_used, stop)
            # a host copy kept past its step would keep the update from reusing its buffers
            self.snapshot.forget()
            dispatched = time.monotonic()
            state, read_metrics = program.dispatch(state, step)
            step += 1
            # update step-1's metrics are read while update step runs behind them
            if pending is not None:
                compute_used = self._report(pending, compute_used, None)
            pending = _Pending(step, read_metrics, dispatched)
            due = [hook for hook in self.hooks if hook.due(step)]
            waiting = [hook for hook in due if hook.waits]
            hash_due = self.cadence.due(step)
            if waiting or hash_due or step == self.max_steps:
                for hook in waiting:
                    if hook.settle is not None:
                        hook.settle(step)
                compute_used = self._report(pending, compute_used, state if hash_due else None)
                pending = None
            try:
                for hook in due:
                    hook.run(state, step, compute_used)
            except Exception:
                # the attempt fails (a background checkpoint write, say): the update already
                # computed is still reported before its ``failed`` event
                if pending is not None:
                    self._report(pending, compute_used, None)
                raise
        # the last update was reported in the loop (``step == max_steps`` waits for it)
        return Finished(state, step, compute_used)

    def _near_compute_budget(self, compute_used: float) -> bool:
        """Whether the compute budget could run out within the pending update: then the loop
        waits for it before deciding. Far from the end (more than three of the longest
        updates so far left) the decision cannot change by one update and nothing waits."""
        budget = self.stopping.limits.get("max_compute_seconds")
        return bool(budget) and budget - compute_used <= 3 * self._longest_update

    def _report(self, pending: _Pending, compute_used: float, hashed_state) -> float:
        """Read ``pending``'s metrics back (waiting for its update), emit its ``update`` event;
        returns the compute used including it."""
        program, step = self.program, pending.step
        metrics = pending.read_metrics()
        bad = non_finite(metrics)
        if bad is not None:
            raise Diverged(step, *bad)
        ready = time.monotonic()
        # the update's own time: from its dispatch, or from when the device finished the
        # previous one if it was still busy with that one; a program whose dispatch does the
        # whole update before returning (grpo: rollouts on the host) measured it itself, and
        # the loop's figure would hold the next update's instead
        seconds = ready - max(pending.dispatched, self._last_ready)
        seconds = metrics.pop("update_seconds", seconds)
        self._last_ready = ready
        self._longest_update = max(self._longest_update, seconds)
        compute_used += seconds
        self.progress.steps_completed = step
        update = {
            "step": step,
            "examples": program.examples_per_step,
            "tokens": program.tokens_per_step,
            "seconds": seconds,
            **metrics,
        }
        if hashed_state is not None:
            # Both from one host copy: the whole-state hash, and one per part so that a
            # divergence can be named (params, opt_state, rng, step, cursor).
            update["state_hash"], update["part_hashes"] = self.snapshot.hashes_of(
                hashed_state, step
            )
            update["state_hash_version"] = STATE_HASH_VERSION
        self.events.emit("update", **update)
        self.progress.metrics["final_loss"] = metrics.get("loss")
        self.say(
            f"update {step}/{self.max_steps} loss={metrics.get('loss'):.6g} "
            f"({seconds * 1000:.1f} ms)"
        )
        return compute_used
