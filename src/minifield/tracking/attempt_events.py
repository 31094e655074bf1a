"""An attempt's ``events.jsonl`` read incrementally, and what each event becomes in MLflow.

Only complete lines count: a line the worker is still writing (no newline yet) is left
for the next read, so a byte offset right after a delivered event is a safe place to
resume. Every metric point has a deterministic identity, the event's own values: key,
``step`` (the training step), ``timestamp`` (the event's wall time in ms) and value, so the
same event always becomes the same points.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

#: event fields that are bookkeeping, not measurements
_NOT_METRICS = {"seq", "time", "mono", "step"}
#: renamed so that they say what they measure
_RENAMED = {"seconds": "update_seconds"}
TERMINAL = ("completed", "failed", "preempted", "limit_reached")


@dataclass(frozen=True)
class Point:
    key: str
    value: float
    timestamp: int
    step: int

    def identity(self) -> tuple:
        return (self.key, self.step, self.timestamp, self.value)


@dataclass
class Batch:
    """Consecutive complete events: ``first_seq``..``last_seq``, ending at ``end_offset``."""

    events: list[dict] = field(default_factory=list)
    end_offset: int = 0

    @property
    def first_seq(self) -> int:
        return self.events[0]["seq"]

    @property
    def last_seq(self) -> int:
        return self.events[-1]["seq"]


def read_batch(path: Path, offset: int, max_events: int) -> Batch:
    """Up to ``max_events`` complete events starting at byte ``offset`` (none: empty batch)."""
    batch = Batch(end_offset=offset)
    if not path.is_file():
        return batch
    with open(path, "rb") as handle:
        handle.seek(offset)
        position = offset
        while len(batch.events) < max_events:
            line = handle.readline(1 << 22)
            if not line.endswith(b"\n"):
                break  # end of file, or a line still being written
            position += len(line)
            text = line.decode("utf-8", errors="replace").strip()
            if not text:
                batch.end_offset = position
                continue
            try:
                event = json.loads(text)
            except ValueError:
                event = None
            if isinstance(event, dict) and isinstance(event.get("seq"), int):
                batch.events.append(event)
            batch.end_offset = position
    return batch


def metric_points(event: dict) -> list[Point]:
    """The metric points of one event: every number of an ``update`` (loss, learning rate,
    update seconds, examples, tokens, ...; a mixture of experts' ``expert_load`` list as
    ``expert_load/NN``, one per expert) and every number of an ``evaluation``'s metrics
    (as ``eval/<name>``), at the event's training step."""
    kind = event.get("type")
    step = event.get("step")
    if not isinstance(step, int):
        return []
    timestamp = int(round(float(event["time"]) * 1000))
    if kind == "update":
        values = {
            _RENAMED.get(key, key): value for key, value in event.items() if key not in _NOT_METRICS
        }
        # a mixture of experts' per-expert shares: one metric per expert
        for index, share in enumerate(values.pop("expert_load", None) or []):
            values[f"expert_load/{index:02d}"] = share
    elif kind == "evaluation" and isinstance(event.get("metrics"), dict):
        values = {f"eval/{key}": value for key, value in event["metrics"].items()}
    else:
        return []
    return [
        Point(key, float(value), timestamp, step)
        for key, value in sorted(values.items())
        if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    ]


def run_tags(event: dict) -> dict[str, str]:
    """Tags an event sets on its attempt's run (the last one wins: tags are idempotent)."""
    kind = event.get("type")
    if kind in TERMINAL:
        tags = {"minifield.attempt_status": kind}
        if kind == "completed" and event.get("final_state_hash"):
            tags["minifield.final_state_hash"] = str(event["final_state_hash"])
        return tags
    if kind == "checkpoint_committed":
        return {"minifield.last_checkpoint_step": str(event.get("step"))}
    return {}
