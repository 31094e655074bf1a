"""The persisted delivery cursor of one attempt: what the server has accepted.

``<state_dir>/destinations/<destination>/attempts/<attempt_id>.json`` (the state dir of
one tracking server and experiment: ``TrackingSettings.destination_state_dir``)::

    {"attempt_id", "computation_digest", "run_id", "delivered_seq", "offset", "inflight"}

``delivered_seq`` is the last event sequence number whose batch the server accepted
(-1: none), ``offset`` the byte offset in ``events.jsonl`` right after it. Before a batch is
sent its range is recorded as ``inflight``; only after the server accepted it does the cursor
advance (and ``inflight`` clear), each time by an atomic replace of the file. A process killed
at any point therefore leaves either the old cursor (batch not sent, or sent but not
recorded) or the new one. In the first case the next delivery finds ``inflight`` and asks the
server which of those points it already holds before sending the rest (see
:meth:`minifield.tracking.delivery.Delivery.deliver_attempt`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

from .. import atomic


@dataclass
class Cursor:
    attempt_id: str
    computation_digest: str
    run_id: str | None = None
    delivered_seq: int = -1
    offset: int = 0
    inflight: dict | None = None  # {"first_seq", "last_seq", "end_offset"}
    finished: bool = False

    @classmethod
    def load(cls, path: Path, attempt_id: str, computation_digest: str) -> Cursor:
        if not path.is_file():
            return cls(attempt_id, computation_digest)
        document = atomic.read_json(path)
        cursor = cls(**document)
        if cursor.attempt_id != attempt_id or cursor.computation_digest != computation_digest:
            raise ValueError(
                f"{path}: cursor of attempt {cursor.attempt_id} ({cursor.computation_digest}), "
                f"not of {attempt_id} ({computation_digest})"
            )
        return cursor

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic.write_json(path, asdict(self))


def path_for(state_dir: Path, attempt_id: str) -> Path:
    return Path(state_dir) / "attempts" / f"{attempt_id}.json"
