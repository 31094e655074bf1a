"""The pointer ``active.json``: which artifact is current, which was before, every move.

``{"format", "current", "previous", "history": [{seq, action, from, to, time, pid,
acceptance}, ...]}``. It is only ever replaced whole (atomic write), under the store
lock, after the gate passed; an unreadable pointer is never overwritten.
"""

from __future__ import annotations

import datetime as dt
import os
from pathlib import Path

from .. import atomic
from .errors import Refused, StoreError
from .layout import POINTER_FORMAT


def now_iso() -> str:
    return dt.datetime.now(dt.UTC).isoformat(timespec="milliseconds")


def read(path: Path) -> dict:
    """The pointer at ``path``, or an empty one when nothing was ever activated."""
    if not path.exists():
        return {"format": POINTER_FORMAT, "current": None, "previous": None, "history": []}
    try:
        pointer = atomic.read_json(path)
    except ValueError as exc:
        raise StoreError(f"{path}: unreadable ({exc}); refusing to overwrite it") from exc
    if not isinstance(pointer, dict) or not isinstance(pointer.get("history"), list):
        raise StoreError(f"{path}: not a store pointer; refusing to overwrite it")
    return pointer


def rollback_target(pointer: dict, path: Path) -> str:
    """The artifact a rollback re-activates: the pointer's ``previous``."""
    target = pointer.get("previous")
    if not target:
        raise Refused(None, [f"nothing to roll back to: {path} has no previous"])
    return target


def moved(before: dict, action: str, target: str, acceptance: dict | None) -> dict:
    """The pointer after moving ``before`` to ``target``, with the move in its history."""
    history = list(before.get("history", []))
    move = {
        "seq": len(history),
        "action": action,
        "from": before.get("current"),
        "to": target,
        "time": now_iso(),
        "pid": os.getpid(),
        "acceptance": acceptance,
    }
    return {
        "format": POINTER_FORMAT,
        "current": target,
        "previous": before.get("current"),
        "history": [*history, move],
    }


def write(path: Path, pointer: dict) -> None:
    atomic.write_json(path, pointer)
