"""Continuing a computation from a previous attempt, which is read and never written.

Before anything else the previous attempt is checked (:func:`check`): it must be an attempt
of the same computation, under the same environment fingerprint unless the change is
explicitly allowed. A completed previous attempt is adopted instead of trained again
(:func:`completed`). Otherwise training restarts from the newest checkpoint along the chain
of attempts that verifies (:func:`restore`), or from step 0 when none does.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .. import atomic
from ..state import checkpoint, export
from ..state.checkpoint import CheckpointRecord
from . import chain as attempts
from . import environment
from .events import EventLog
from .events import read as read_events
from .layout import ATTEMPT_JSON, EVENTS, EXPORT, RESULT
from .result import Progress


class ResumeRefused(Exception):
    """The previous attempt cannot be resumed by this recipe/environment (exit 2)."""


@dataclass(frozen=True)
class Previous:
    """A previous attempt this one may continue."""

    directory: Path
    #: bit-defining environment fields that changed, as ``{field: {recorded, current}}``,
    #: when the change was allowed; None when nothing changed
    environment_override: dict | None


@dataclass(frozen=True)
class Completed:
    """A completed attempt along the chain: resuming it trains nothing."""

    directory: Path
    result: dict


@dataclass(frozen=True)
class Restored:
    state: Any
    checkpoint: CheckpointRecord
    #: read by slices (a state laid out over devices): its hash is checked once placed
    sliced: bool = False


def check(
    previous: Path,
    *,
    computation_digest: str,
    env: dict,
    allow_environment_change: bool,
) -> Previous:
    """The previous attempt, if this recipe under this environment may continue it."""
    info_path = previous / ATTEMPT_JSON
    if not info_path.is_file():
        raise ResumeRefused(f"{previous} is not an attempt directory (no {ATTEMPT_JSON})")
    info = atomic.read_json(info_path)
    if info.get("computation_digest") != computation_digest:
        raise ResumeRefused(
            f"refusing to resume {previous}: it ran computation {info.get('computation_digest')}, "
            f"but this recipe is computation {computation_digest} "
            "(a changed recipe is a new computation; start it fresh)"
        )
    diff = environment.differences(info.get("environment", {}), env)
    if diff and not allow_environment_change:
        fields = ", ".join(f"{k}: {v['recorded']!r} -> {v['current']!r}" for k, v in diff.items())
        raise ResumeRefused(
            f"refusing to resume {previous}: the environment changed ({fields}); this can change "
            "the bits of the result. Restore the environment, or pass --allow-environment-change "
            "to accept it (the override is recorded)"
        )
    return Previous(previous, diff or None)


def compute_seconds(attempt_dir: Path) -> float:
    """Training seconds spent by this attempt and every attempt before it (from raw events)."""
    info_path = attempt_dir / ATTEMPT_JSON
    before = (
        atomic.read_json(info_path).get("compute_seconds_before", 0.0)
        if info_path.is_file()
        else 0.0
    )
    own = 0.0
    events_path = attempt_dir / EVENTS
    if events_path.is_file():
        events, _ = read_events(events_path)
        own = sum(e.get("seconds", 0.0) for e in events if e["type"] == "update")
    return before + own


def completed(previous: Path) -> Completed | None:
    """The newest attempt along the chain that ended, if it completed; else None."""
    for attempt_dir in attempts.newest_first(previous):
        result_path = attempt_dir / RESULT
        if result_path.is_file():
            result = atomic.read_json(result_path)
            if result.get("status") == "completed":
                return Completed(attempt_dir, result)
            return None
    return None


def restore(
    previous: Path,
    template: Any,
    *,
    computation_digest: str,
    events: EventLog,
    say: Callable[[str], None],
) -> Restored | None:
    """The newest checkpoint along the attempt chain that verifies, or None (start fresh).

    Every checkpoint passed over is named in a ``checkpoint_rejected`` event.
    """
    for step, path in attempts.committed_checkpoints(previous):
        try:
            state, manifest = checkpoint.load(path, template, computation_digest=computation_digest)
        except checkpoint.CheckpointError as exc:
            events.emit("checkpoint_rejected", step=step, path=str(path), reason=str(exc))
            say(f"rejected checkpoint {path}: {exc}")
            continue
        sha = checkpoint.manifest_sha256(path)
        events.emit(
            "restored",
            step=step,
            path=str(path),
            sha256=sha,
            state_hash=manifest["state_hash"],
            state_hash_version=manifest.get("state_hash_version", 1),
        )
        record = CheckpointRecord(step, str(path), sha, manifest["state_hash"])
        return Restored(state, record, sliced=bool(manifest.get("sliced")))
    events.emit(
        "restore_fallback",
        reason="no valid committed checkpoint in the attempt chain; starting from step 0",
    )
    return None


def adopt(
    previous: Completed, directory: Path | None, progress: Progress, events: EventLog
) -> CheckpointRecord | None:
    """Resuming a completed attempt trains nothing and reports the same final state: its
    export copied whole into ``directory`` (None: not the writing process), its progress
    taken over; returns its last checkpoint."""
    source_export = previous.directory / EXPORT
    if source_export.is_dir() and directory is not None:
        export.write_whole(directory / EXPORT, lambda part: shutil.copytree(source_export, part))
    result = previous.result
    progress.steps_completed = result["steps_completed"]
    progress.metrics = result.get("metrics", {})
    progress.inputs = result.get("inputs", [])
    progress.final_state_hash = result.get("final_state_hash")
    # a result written before the versions existed holds a version-1 hash
    progress.state_hash_version = (
        result.get("state_hash_version", 1) if result.get("final_state_hash") else None
    )
    events.emit(
        "already_completed",
        attempt=str(previous.directory),
        final_state_hash=result.get("final_state_hash"),
    )
    return CheckpointRecord.from_dict(result.get("checkpoint"))
