"""Measured signals of a training job, computed from its raw event files only.

Input: the ``events.jsonl`` of every attempt of one job, oldest first (a
resumed attempt follows the one it resumed from). Output: one JSON object whose
field names carry their unit (``_s`` seconds, ``_per_s`` rates, ``_fraction``
shares of job wall time, ``_count`` plain counts).

Clocks: durations inside one attempt come from the monotonic clock (``mono``)
of that process, which is only meaningful locally; the gap between two
attempts (different processes, maybe different hosts) comes from wall-clock
``time`` and is clamped at zero, because wall clocks may step.

Two wall times, one rule each: ``job_wall_time_s`` is the job as its owner
waits for it (every attempt's first-to-last-event span plus the gaps between
attempts); ``attempts_wall_time_s`` is the time worker processes were running
it (the spans alone, no gaps). Capacity planning (:mod:`minifield.observe.capacity`)
takes its seconds per job, update and checkpoint figures from this summary:
``attempts_wall_time_s``, because a worker is free between attempts.

The update duty fraction is the share of job wall time spent inside
synchronized update calls. It is not hardware utilization: it says nothing
about how busy the device was during those calls.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from .. import atomic
from ..attempt.chain import chain as attempt_chain
from ..attempt.events import read as read_events
from ..attempt.layout import EVENTS

SCHEMA = "minifield.summary/1"
TERMINAL = {
    "completed": "completed",
    "already_completed": "completed",
    "failed": "failed",
    "preempted": "preempted",
    "limit_reached": "limit_reached",
}
# Fields each event type must carry for the summary; checked before any arithmetic.
REQUIRED_FIELDS = {
    "update": ("step", "examples", "tokens", "seconds"),
    "checkpoint_committed": ("step", "seconds"),
    "compiled": ("seconds",),
    "evaluation": ("seconds",),
    "restored": ("step",),
}
# Fields used when present (packed-sft updates say how many tokens carried loss).
OPTIONAL_FIELDS = {"update": ("loss_tokens",)}
NOT_UTILIZATION = (
    "update_duty_fraction is the share of job wall time spent inside synchronized update "
    "calls; it is not hardware utilization."
)


class SummaryError(Exception):
    """An events file is missing, empty or has an event without a field the summary needs."""


def _number(path: Path, event: dict, name: str) -> float:
    value = event.get(name)
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise SummaryError(
            f"{path}: event seq {event.get('seq')} ({event.get('type')}): field '{name}' must be a "
            f"finite number, got {value!r}"
        )
    return float(value)


def _checked(path: Path, event: dict) -> dict:
    for name in ("time", "mono"):
        _number(path, event, name)
    present = tuple(n for n in OPTIONAL_FIELDS.get(event["type"], ()) if n in event)
    for name in REQUIRED_FIELDS.get(event["type"], ()) + present:
        if _number(path, event, name) < 0:
            raise SummaryError(
                f"{path}: event seq {event.get('seq')} ({event['type']}): field '{name}' must be "
                f">= 0, got {event[name]!r}"
            )
    return event


def load_attempt(path: Path) -> tuple[list[dict], int]:
    """Checked events of one attempt in ``seq`` order, and the number of malformed lines."""
    path = Path(path)
    if not path.is_file():
        raise SummaryError(f"{path}: no such events file")
    try:
        events, malformed = read_events(path)
    except (OSError, ValueError) as exc:
        raise SummaryError(f"{path}: cannot read the events file ({exc})") from None
    if not events:
        raise SummaryError(f"{path}: no events (an events file has one JSON object per line)")
    events = [_checked(path, e) for e in events]
    return sorted(events, key=lambda e: e.get("seq", 0)), len(malformed)


def _ratio(numerator: float, denominator: float) -> float | None:
    return numerator / denominator if denominator > 0 else None


class _Progress:
    """The job's course through its attempts, oldest first: where its state stands and what
    each attempt's events add to the totals."""

    def __init__(self) -> None:
        self.high_water = 0  # highest update step ever completed, in any attempt
        self.durable = 0  # step of the newest committed checkpoint: where a restart resumes
        self.position = 0  # step of the in-memory state of the current attempt
        self.totals = {
            "updates": 0,
            "examples": 0,
            "tokens": 0,
            "loss_tokens": 0,
            "update_s": 0.0,
            "redone_updates": 0,
            "redone_examples": 0,
            "redone_tokens": 0,
            "redone_update_s": 0.0,
            "compile_s": 0.0,
            "resumed_compile_s": 0.0,
            "checkpoint_s": 0.0,
            "checkpoints": 0,
            "evaluation_s": 0.0,
            "lost_uncheckpointed": 0,
            "malformed": 0,
        }
        self.by_step: dict[int, dict] = {}  # a mixture's per-source figures of each update
        self.rewarded: dict[int, dict] = {}  # a reinforcement-learning update's event, by step
        self.between_s = 0.0
        self.previous_last_time = None

    def attempt(self, index: int, path: Path) -> dict:
        """The figures of attempt ``index`` (from 0) from its events file."""
        events, malformed = load_attempt(path)
        self.totals["malformed"] += malformed
        if index > 0:
            # The previous process is gone: its updates after the newest commit are lost.
            self.totals["lost_uncheckpointed"] += self.position - self.durable
            self.position = self.durable
            self.between_s += max(0.0, events[0]["time"] - self.previous_last_time)
        self.previous_last_time = events[-1]["time"]
        attempt = {
            "events_file": str(path),
            "attempt_id": None,
            "status": "interrupted",  # no terminal event: the process died or was killed
            "wall_s": events[-1]["mono"] - events[0]["mono"],
            "updates_count": 0,
            "redone_updates_count": 0,
            "update_s": 0.0,
            "redone_update_s": 0.0,
            "compile_s": 0.0,
            "checkpoint_s": 0.0,
            "checkpoints_count": 0,
            "evaluation_s": 0.0,
            "restored_step_count": None,
            "first_update_step_count": None,
            "completed_steps_count": None,
            "uncheckpointed_updates_count": None,
        }
        for event in events:
            self._count(event, attempt, index, path)
        attempt["completed_steps_count"] = self.position
        attempt["uncheckpointed_updates_count"] = max(0, self.position - self.durable)
        return attempt

    def _count(self, event: dict, attempt: dict, index: int, path: Path) -> None:
        totals, kind = self.totals, event["type"]
        if kind == "attempt_started":
            attempt["attempt_id"] = event.get("attempt_id")
        elif kind == "update":
            self._update(event, attempt, path)
        elif kind == "checkpoint_committed":
            self.durable = int(event["step"])
            # the time the loop spent on it: a background commit's ``seconds`` overlap
            # the updates, only its ``blocking_seconds`` held training up
            held = float(event.get("blocking_seconds", event["seconds"]))
            totals["checkpoints"] += 1
            totals["checkpoint_s"] += held
            attempt["checkpoint_s"] += held
            attempt["checkpoints_count"] += 1
        elif kind == "restored":
            # A rejected newer checkpoint makes the restore point older than ``durable``.
            totals["lost_uncheckpointed"] += max(0, self.durable - int(event["step"]))
            self.position = self.durable = int(event["step"])
            attempt["restored_step_count"] = self.position
        elif kind == "restore_fallback":
            totals["lost_uncheckpointed"] += self.durable
            self.position = self.durable = 0
            attempt["restored_step_count"] = 0
        elif kind == "compiled":
            totals["compile_s"] += float(event["seconds"])
            attempt["compile_s"] += float(event["seconds"])
            if index > 0:
                totals["resumed_compile_s"] += float(event["seconds"])
        elif kind == "evaluation":
            totals["evaluation_s"] += float(event["seconds"])
            attempt["evaluation_s"] += float(event["seconds"])
        elif kind in TERMINAL:
            attempt["status"] = TERMINAL[kind]

    def _update(self, event: dict, attempt: dict, path: Path) -> None:
        totals, step = self.totals, int(event["step"])
        seconds = float(event["seconds"])
        totals["updates"] += 1
        totals["examples"] += int(event["examples"])
        totals["tokens"] += int(event["tokens"])
        totals["loss_tokens"] += int(event.get("loss_tokens", 0))
        totals["update_s"] += seconds
        attempt["updates_count"] += 1
        attempt["update_s"] += seconds
        if attempt["first_update_step_count"] is None:
            attempt["first_update_step_count"] = step
        if step <= self.high_water:  # redone after a restart
            totals["redone_updates"] += 1
            totals["redone_examples"] += int(event["examples"])
            totals["redone_tokens"] += int(event["tokens"])
            totals["redone_update_s"] += seconds
            attempt["redone_updates_count"] += 1
            attempt["redone_update_s"] += seconds
        if "sources" in event:  # a mixture's update: its rows per source
            self.by_step[step] = _sources_of(path, event)
        if isinstance(event.get("reward"), int | float):  # rollouts (grpo)
            self.rewarded[step] = event
        self.position = step
        self.high_water = max(self.high_water, step)


def summarize(event_files: list[Path]) -> dict[str, Any]:
    """The summary of one job from its attempts' event files, oldest attempt first."""
    if not event_files:
        raise SummaryError("no events files given")
    progress = _Progress()
    attempts = [progress.attempt(index, path) for index, path in enumerate(map(Path, event_files))]
    totals, between_s = progress.totals, progress.between_s
    position, durable = progress.position, progress.durable
    attempts_wall_s = sum(a["wall_s"] for a in attempts)
    wall_s = attempts_wall_s + between_s
    update_s = totals["update_s"]
    productive_s = update_s - totals["redone_update_s"]
    lost_s = totals["redone_update_s"] + between_s + totals["resumed_compile_s"]
    other_s = wall_s - (
        update_s + totals["compile_s"] + totals["checkpoint_s"] + totals["evaluation_s"] + between_s
    )
    extra = {"sources": trained_by_source(progress.by_step, position)} if progress.by_step else {}
    if progress.rewarded:
        extra["rollouts"] = rollout_summary(progress.rewarded)
    productive_examples = totals["examples"] - totals["redone_examples"]
    productive_tokens = totals["tokens"] - totals["redone_tokens"]
    return {
        "schema": SCHEMA,
        "event_files": [str(p) for p in event_files],
        "attempts_count": len(attempts),
        "final_status": attempts[-1]["status"],
        "updates_count": totals["updates"],
        "processed_examples_count": totals["examples"],
        "processed_tokens_count": totals["tokens"],
        "processed_loss_tokens_count": totals["loss_tokens"],
        "update_time_s": update_s,
        "update_examples_per_s": _ratio(totals["examples"], update_s),
        "update_tokens_per_s": _ratio(totals["tokens"], update_s),
        "job_wall_time_s": wall_s,
        "attempts_wall_time_s": attempts_wall_s,
        "job_examples_per_s": _ratio(totals["examples"], wall_s),
        "job_tokens_per_s": _ratio(totals["tokens"], wall_s),
        "job_productive_examples_per_s": _ratio(productive_examples, wall_s),
        "job_productive_tokens_per_s": _ratio(productive_tokens, wall_s),
        "update_duty_fraction": _ratio(update_s, wall_s),
        "completed_steps_count": position,
        "checkpointed_steps_count": durable,
        "uncheckpointed_updates_count": max(0, position - durable),
        "committed_checkpoints_count": totals["checkpoints"],
        "compile_s": totals["compile_s"],
        "checkpoint_s": totals["checkpoint_s"],
        "evaluation_s": totals["evaluation_s"],
        "restarts": {
            "restarts_count": len(attempts) - 1,
            "redone_updates_count": totals["redone_updates"],
            "redone_examples_count": totals["redone_examples"],
            "redone_tokens_count": totals["redone_tokens"],
            "redone_update_s": totals["redone_update_s"],
            "lost_uncheckpointed_updates_count": totals["lost_uncheckpointed"],
            "between_attempts_s": between_s,
            "resumed_compile_s": totals["resumed_compile_s"],
            "lost_s": lost_s,
            "lost_fraction": _ratio(lost_s, wall_s),
        },
        "goodput": {
            "productive_update_s": productive_s,
            "redone_update_s": totals["redone_update_s"],
            "compile_s": totals["compile_s"],
            "checkpoint_s": totals["checkpoint_s"],
            "evaluation_s": totals["evaluation_s"],
            "between_attempts_s": between_s,
            "other_s": other_s,
            "productive_fraction": _ratio(productive_s, wall_s),
        },
        "attempts": attempts,
        "malformed_lines_count": totals["malformed"],
        "note": NOT_UTILIZATION,
        **extra,
    }


#: the parts of a reinforcement-learning update's time its ``update`` event reports
ROLLOUT_PARTS = ("rollout", "reward", "reference", "policy")


def rollout_summary(by_step: dict[int, dict]) -> dict:
    """The rollouts of the updates that count (a redone update's later event wins): the mean
    reward of the first and last and over all, and where the updates' time went."""
    events = [by_step[s] for s in sorted(by_step)]

    def mean(key: str) -> float | None:
        values = [float(e[key]) for e in events if isinstance(e.get(key), int | float)]
        return sum(values) / len(values) if values else None

    return {
        "updates_count": len(events),
        "reward_first_update": float(events[0]["reward"]),
        "reward_last_update": float(events[-1]["reward"]),
        "reward_mean": mean("reward"),
        "completion_length_mean": mean("completion_length"),
        "truncated_fraction_mean": mean("truncated_fraction"),
        **{
            f"{part}_s": sum(float(e.get(f"{part}_seconds", 0.0)) for e in events)
            for part in ROLLOUT_PARTS
        },
    }


def _sources_of(path: Path, event: dict) -> dict:
    """An update's ``sources`` (input name → rows, loss_tokens, epochs), checked."""
    sources = event["sources"]
    if not isinstance(sources, dict) or not all(isinstance(v, dict) for v in sources.values()):
        raise SummaryError(
            f"{path}: event seq {event.get('seq')} (update): field 'sources' must map each "
            f"input to its figures, got {sources!r}"
        )
    for figures in sources.values():
        for name in ("rows", "loss_tokens", "epochs"):
            _number(path, {**event, name: figures.get(name)}, name)
    return sources


def trained_by_source(by_step: dict[int, dict], position: int) -> dict:
    """What the final state was trained on, per source of a mixture: rows and trained tokens
    summed over updates ``1 .. position`` (a redone update counted once, as it was last
    run), and the epochs read of each source after update ``position``."""
    steps = [step for step in sorted(by_step) if step <= position]
    names = sorted({name for step in steps for name in by_step[step]})
    last = by_step[steps[-1]] if steps else {}
    return {
        name: {
            "trained_rows_count": sum(int(by_step[s].get(name, {}).get("rows", 0)) for s in steps),
            "trained_loss_tokens_count": sum(
                int(by_step[s].get(name, {}).get("loss_tokens", 0)) for s in steps
            ),
            "epochs_count": float(last.get(name, {}).get("epochs", 0.0)),
        }
        for name in names
    }


def attempt_event_files(attempt_dir: Path) -> list[Path]:
    """``events.jsonl`` of an attempt and of every attempt it resumed from, oldest first."""
    try:
        chain = attempt_chain(Path(attempt_dir))
    except (OSError, ValueError, AttributeError) as exc:
        # an attempt.json that is not JSON, or not an object, breaks the chain
        raise SummaryError(
            f"{attempt_dir}: cannot follow the attempts it resumed from ({exc})"
        ) from None
    files = [d / EVENTS for d in chain if (d / EVENTS).is_file()]
    if not files:
        raise SummaryError(f"{attempt_dir}: no events.jsonl in the attempt or the ones before it")
    return files


def summarize_training(train_result: Path, out_summary: Path) -> dict[str, Any]:
    """Summary of the attempts behind a ``train/result.json`` (its ``attempt_dir`` chain)."""
    result = atomic.read_json(train_result)
    if "attempt_dir" not in result:
        raise SummaryError(f"{train_result}: field 'attempt_dir' missing (a train rule result)")
    summary = summarize(attempt_event_files(Path(result["attempt_dir"])))
    summary["computation_digest"] = result.get("computation_digest")
    atomic.write_json(out_summary, summary)
    return summary
