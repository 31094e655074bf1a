"""An attempt's events delivered to its attempt run exactly once (:mod:`.runs` says which
runs exist and what goes in them).

Each **attempt run** holds that attempt's events: every ``update``'s numbers as metrics at
``step`` = the training step, the worker's evaluation events, its status. A resumed
computation has one attempt run per attempt, so a redone step appears once per attempt that
ran it — exactly as the events files say. Delivery follows :mod:`.cursor`'s protocol: a
batch is recorded as in flight before it is sent and as delivered after the server accepted
it, so a delivery killed in between sends only what the run lacks on its next start.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .. import atomic
from ..supervision import locks
from . import attempt_events
from .cursor import Cursor, path_for
from .runs import LOCK_WAIT_S, Runs, provenance_of


class Delivery(Runs):
    # -- an attempt's events, exactly once ---------------------------------------------------
    def deliver_attempt(
        self,
        attempt_dir: Path,
        *,
        params: dict[str, str] | None = None,
        provenance: dict[str, Any] | None = None,
        follow: threading.Event | None = None,
        batch_events: int = 100,
        poll_s: float = 0.2,
        on_batch: Callable[[Cursor], None] | None = None,
        fault_kill_after_send: int | None = None,
    ) -> Cursor:
        """Deliver ``attempt_dir``'s events from its cursor on.

        Without ``follow`` it delivers what the file holds and returns. With ``follow`` (an
        event meaning "the worker has ended") it keeps tailing the file until it has delivered
        the attempt's terminal event, or ``follow`` is set and nothing is left to read.
        ``fault_kill_after_send=K`` (tests only) SIGKILLs this process right after the server
        accepted batch K and before the cursor records it: the hardest place to be killed.
        """
        attempt_dir = Path(attempt_dir)
        attempt = _wait_for_attempt(attempt_dir, follow, poll_s)
        if attempt is None:
            raise FileNotFoundError(f"{attempt_dir / 'attempt.json'}: no such attempt")
        cursor_path = path_for(self.state_dir, attempt["attempt_id"])
        lock = self.state_dir / "locks" / f"attempt-{attempt['attempt_id']}.lock"
        lock.parent.mkdir(parents=True, exist_ok=True)
        with locks.held(lock, {"pid": os.getpid()}, timeout_s=LOCK_WAIT_S):
            cursor = Cursor.load(cursor_path, attempt["attempt_id"], attempt["computation_digest"])
            if cursor.run_id is None:
                parent = self.computation_run(provenance or provenance_of(attempt), params)
                cursor.run_id = self.attempt_run(parent, attempt)
                cursor.save(cursor_path)
            events_path = attempt_dir / "events.jsonl"
            if cursor.inflight is not None:
                self._resend_inflight(cursor, cursor_path, events_path, on_batch)
            sent = 0
            terminal_seen = cursor.finished
            while True:
                batch = attempt_events.read_batch(events_path, cursor.offset, batch_events)
                if not batch.events:
                    if batch.end_offset != cursor.offset:  # blank or malformed lines only
                        cursor.offset = batch.end_offset
                        cursor.save(cursor_path)
                    if follow is None or terminal_seen or follow.is_set():
                        break
                    follow.wait(poll_s)
                    continue
                points = [p for e in batch.events for p in attempt_events.metric_points(e)]
                cursor.inflight = {"first_seq": batch.first_seq, "last_seq": batch.last_seq}
                cursor.save(cursor_path)
                self.log_points(cursor.run_id, points, _tags_of(batch.events))
                sent += 1
                if fault_kill_after_send is not None and sent >= fault_kill_after_send:
                    import signal

                    os.kill(os.getpid(), signal.SIGKILL)
                terminal_seen = terminal_seen or any(
                    e.get("type") in attempt_events.TERMINAL for e in batch.events
                )
                self._advance(cursor, cursor_path, batch, on_batch)
            if not terminal_seen and not cursor.finished and cursor.delivered_seq >= 0:
                # Killed after the terminal event's batch was accepted but before the run
                # was ended: the delivered part of the file says whether it is over.
                terminal_seen = _terminal_delivered(events_path, cursor.delivered_seq)
            if terminal_seen and not cursor.finished:
                self._finish_attempt_run(cursor, events_path)
                cursor.finished = True
                cursor.save(cursor_path)
        return cursor

    def _resend_inflight(self, cursor: Cursor, path: Path, events_path: Path, on_batch) -> None:
        """The batch in flight was sent, perhaps (partly) accepted, not recorded: send only
        what the run is missing, then record it."""
        inflight = cursor.inflight
        batch = attempt_events.read_batch(
            events_path, cursor.offset, inflight["last_seq"] - inflight["first_seq"] + 1
        )
        batch = _cut(batch, inflight["last_seq"])
        points = [p for e in batch.events for p in attempt_events.metric_points(e)]
        self.log_points_once(cursor.run_id, points)
        self.set_tags(cursor.run_id, _tags_of(batch.events))
        self._advance(cursor, path, batch, on_batch)

    def _advance(self, cursor: Cursor, path: Path, batch, on_batch) -> None:
        if batch.events:
            cursor.delivered_seq = batch.last_seq
        cursor.offset = batch.end_offset
        cursor.inflight = None
        cursor.save(path)
        if on_batch is not None:
            on_batch(cursor)

    def _finish_attempt_run(self, cursor: Cursor, events_path: Path) -> None:
        events, _ = _read_all(events_path)
        terminal = [e for e in events if e.get("type") in attempt_events.TERMINAL]
        last = terminal[-1] if terminal else {}
        status = {"completed": "FINISHED", "failed": "FAILED"}.get(last.get("type"), "KILLED")
        end = int(round(float(last.get("time", time.time())) * 1000))
        self.connection.call(
            "end run", self.client.set_terminated, cursor.run_id, status=status, end_time=end
        )


def _cut(batch, last_seq: int):
    batch.events = [e for e in batch.events if e["seq"] <= last_seq]
    return batch


def _tags_of(events: list[dict]) -> dict[str, str]:
    tags: dict[str, str] = {}
    for event in events:
        tags.update(attempt_events.run_tags(event))
    return tags


def _terminal_delivered(events_path: Path, delivered_seq: int) -> bool:
    events, _ = _read_all(events_path)
    return any(
        e.get("type") in attempt_events.TERMINAL and e.get("seq", -1) <= delivered_seq
        for e in events
    )


def _read_all(path: Path) -> tuple[list[dict], list[dict]]:
    from ..attempt import events

    return events.read(path)


def _wait_for_attempt(attempt_dir: Path, follow: threading.Event | None, poll_s: float):
    """``attempt.json`` (a worker writes it at start); while following, wait for it."""
    path = attempt_dir / "attempt.json"
    while not path.is_file():
        if follow is None or follow.is_set():
            return None
        follow.wait(poll_s)
    return atomic.read_json(path)
