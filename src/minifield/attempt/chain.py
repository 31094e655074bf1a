"""Attempt directories and the chain of attempts a computation took.

Every attempt writes ``attempt.json`` naming the attempt it resumed from, so the
whole history of a computation can be walked back from its latest attempt.
This module imports nothing heavy (no JAX): summaries, plots and capacity
figures use it without starting the training stack. :func:`committed_checkpoints`, the one
walk of the checkpoints along the chain (resume, evaluation and the proof use it), loads the
checkpoint format only when called.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from .. import atomic
from .layout import ATTEMPT_JSON, CHECKPOINTS


def chain(attempt_dir: Path) -> list[Path]:
    """The attempt and the attempts it resumed from, oldest first (cycle-safe)."""
    found, seen, current = [], set(), Path(attempt_dir)
    while current is not None and current.resolve() not in seen:
        seen.add(current.resolve())
        found.append(current)
        info = current / ATTEMPT_JSON
        previous = atomic.read_json(info).get("resumed_from") if info.is_file() else None
        current = Path(previous) if previous else None
    return list(reversed(found))


def newest_first(attempt_dir: Path) -> list[Path]:
    """The attempt and the attempts it resumed from, newest first (the order a resume searches)."""
    return list(reversed(chain(attempt_dir)))


def committed_checkpoints(attempt_dir: Path) -> Iterator[tuple[int, Path]]:
    """``(step, directory)`` of every committed checkpoint along the chain of attempts, newest
    attempt first and newest step first within an attempt: the order a resume tries them."""
    from ..state import checkpoint  # the format imports JAX; walking attempts does not

    for directory in newest_first(attempt_dir):
        checkpoints = directory / CHECKPOINTS
        for step in reversed(checkpoint.committed_steps(checkpoints)):
            yield step, checkpoints / checkpoint.step_dir_name(step)
