"""How an attempt's ending is said: the ending of a divergence or of a stop, the last event and
``result.json``, written even on a disk another process filled (what is still refused is said
on stderr, and the ending becomes ``io_failed``)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from .. import atomic
from ..state.checkpoint import CheckpointRecord
from .events import EventLog
from .result import AttemptError, Ending, Progress
from .stopping import Preempt
from .update_loop import Diverged, Stopped


def diverged(
    exc: Diverged, newest: CheckpointRecord | None, events: EventLog, say: Callable[[str], None]
) -> Ending:
    """A non-finite update ends the attempt failed: nothing of that state is kept (no
    checkpoint, no export); the reason names the update and the last committed checkpoint,
    whose state was reached by updates all seen finite."""
    if newest is None:
        last = "no checkpoint was committed"
    else:
        last = f"the last finite state is the committed checkpoint of step {newest.step}"
        last += f" ({newest.path})" if newest.path else ""
    # handled like the ending's own event (record): the events file may be full, and a
    # raise from here would skip result.json
    refused = atomic.io_refusal(
        lambda: events.emit(
            "diverged",
            step=exc.step,
            metric=exc.metric,
            value=str(exc.value),
            checkpoint=newest.as_dict() if newest else None,
        )
    )
    if refused is not None:
        say(f"the diverged event was not written: {refused}")
    say(f"{exc}; {last}")
    message = f"{exc}: training diverged; {last}; nothing was exported"
    return Ending.failed(AttemptError("diverged", message))


def stopped(end: Stopped, committed: CheckpointRecord, events: EventLog) -> Ending:
    """A loop stopped before its last update ends ``preempted`` (a signal: the checkpoint it
    committed is named) or ``limit_reached``; either resumes from that checkpoint."""
    if isinstance(end.stop, Preempt):
        events.emit(
            "preempted",
            durable=True,
            signal=end.stop.signal,
            reason=end.stop.reason,
            step=end.step,
            checkpoint_sha256=committed.sha256,
            path=committed.path,
        )
        return Ending.preempted()
    events.emit("limit_reached", durable=True, step=end.step, reason=end.stop.reason)
    return Ending.limit_reached(end.stop.reason)


def record(
    ending: Ending,
    events: EventLog,
    progress: Progress,
    *,
    result_file: Path | None,
    document: Callable[[Ending], dict],
    say: Callable[[str], None],
) -> Ending:
    """The last event, then ``result_file`` (None: not the writing process), then the event
    log closed. Returns the ending as recorded: an ending that could not be recorded in full
    becomes ``io_failed`` (phase ``finish``)."""
    try:
        refused = atomic.io_refusal(lambda: _emit(ending, events, progress))
        if refused is not None:
            say(f"the attempt's last event was not written: {refused}")
            if ending.status != "io_failed":
                # what ended the attempt (a divergence, say) stays in result.json's message
                why = f" ({ending.error.phase}: {ending.error.message})" if ending.error else ""
                error = AttemptError(
                    "finish", f"the {ending.status} ending{why} was not recorded: {refused}"
                )
                ending = Ending.io_failed(error)
        if result_file is not None:
            final = ending
            refused = atomic.io_refusal(lambda: atomic.write_json(result_file, document(final)))
            if refused is not None:
                say(f"{ending.status}, but {result_file.name} was not written: {refused}")
                ending = Ending.io_failed(AttemptError("finish", str(refused)))
    finally:
        try:
            events.close()
        except OSError as exc:
            say(str(exc))
    return ending


def _emit(ending: Ending, events: EventLog, progress: Progress) -> None:
    if ending.status == "completed":
        events.emit(
            "completed",
            durable=True,
            steps=progress.steps_completed,
            final_state_hash=progress.final_state_hash,
            state_hash_version=progress.state_hash_version,
        )
    elif ending.status == "failed":
        events.emit("failed", durable=True, **ending.error.as_dict())
    elif ending.status in ("io_failed", "device_busy"):
        events.emit("failed", durable=True, status=ending.status, **ending.error.as_dict())
