"""Attempt directories and the chain of attempts a computation took.

Every attempt writes ``attempt.json`` naming the attempt it resumed from, so the
whole history of a computation can be walked back from its latest attempt.
This module imports nothing heavy (no JAX): summaries, plots and capacity
figures use it without starting the training stack.
"""

from __future__ import annotations

from pathlib import Path

from .. import atomic
from .layout import ATTEMPT_JSON


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
