"""The attempt's event stream: one JSON object per line, contiguous ``seq``, wall and monotonic time.

Each event goes to ``events.jsonl`` (flushed per line; fsynced at durable
moments) and to stdout, so a supervisor can follow a worker live.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any, TextIO


class EventLog:
    """Appends events to ``path`` and echoes them to ``echo``.

    With ``path=None`` and ``echo=None`` it writes nothing at all: what the processes
    of a multi-process attempt other than process 0 use, so that one ``events.jsonl``
    and one stdout stream describe the attempt.
    """

    def __init__(self, path: Path | None, echo: TextIO | None = sys.stdout):
        self.path = path
        self._handle = open(path, "a", encoding="utf-8") if path is not None else None
        self._echo = echo
        self._seq = 0

    def emit(self, type_: str, *, durable: bool = False, **fields: Any) -> dict:
        event = {
            "seq": self._seq,
            "time": time.time(),
            "mono": time.monotonic(),
            "type": type_,
            **fields,
        }
        line = json.dumps(event, sort_keys=True, allow_nan=False)
        if self._handle is not None:
            self._handle.write(line + "\n")
            self._handle.flush()
            if durable:
                os.fsync(self._handle.fileno())
        if self._echo is not None:
            self._echo.write(line + "\n")
            self._echo.flush()
        self._seq += 1
        return event

    def close(self) -> None:
        if self._handle is None:
            return
        self._handle.flush()
        os.fsync(self._handle.fileno())
        self._handle.close()


def read(path: Path) -> tuple[list[dict], list[dict]]:
    """Parse an events file: (events, malformed lines as {line, text})."""
    events, malformed = [], []
    with open(path, encoding="utf-8", errors="replace") as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                value = json.loads(line)
            except json.JSONDecodeError:
                malformed.append({"line": number, "text": line.rstrip("\n")[:2000]})
                continue
            if isinstance(value, dict) and "type" in value:
                events.append(value)
            else:
                malformed.append({"line": number, "text": line.rstrip("\n")[:2000]})
    return events, malformed
