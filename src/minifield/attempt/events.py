"""The attempt's event stream: one JSON object per line, contiguous ``seq``, wall and monotonic time.

Each event goes to ``events.jsonl`` (flushed per line; fsynced at durable
moments) and to stdout, so a supervisor can follow a worker live. The file is the
record; stdout is a courtesy: when its reader goes away (``minifield-worker ... | head``,
a supervisor that died), echoing stops, the events file carries on, and the log tells
whoever asked (``on_echo_closed``) so that the attempt can end cleanly.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO


def write_line(stream: TextIO, line: str) -> str | None:
    """Write ``line`` and a newline to ``stream`` and flush it; on failure, the reason.

    A stream whose reader went away raises ``BrokenPipeError`` on this write and on every
    later flush, including the interpreter's own at exit (a traceback and exit 120). So the
    stream's descriptor is pointed at ``/dev/null`` first: what is still buffered and anything
    written later is dropped quietly.
    """
    try:
        stream.write(line + "\n")
        stream.flush()
        return None
    except OSError as exc:
        reason = (
            "closed (its reader went away)"
            if isinstance(exc, BrokenPipeError)
            else f"unwritable ({exc})"
        )
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(devnull, stream.fileno())
        finally:
            os.close(devnull)
    except (OSError, ValueError, AttributeError):  # not a real descriptor (a test's StringIO)
        pass
    return reason


class EventLog:
    """Appends events to ``path`` and echoes them to ``echo``.

    With ``path=None`` and ``echo=None`` it writes nothing at all: what the processes
    of a multi-process attempt other than process 0 use, so that one ``events.jsonl``
    and one stdout stream describe the attempt.
    """

    def __init__(
        self,
        path: Path | None,
        echo: TextIO | None = sys.stdout,
        on_echo_closed: Callable[[str], None] | None = None,
    ):
        self.path = path
        self._handle = open(path, "a", encoding="utf-8") if path is not None else None
        self._echo = echo
        self._on_echo_closed = on_echo_closed
        self._seq = 0
        # a background checkpoint writer may emit (a fault's last word) while the loop does
        self._lock = threading.Lock()

    def emit(self, type_: str, *, durable: bool = False, **fields: Any) -> dict:
        with self._lock:
            return self._emit(type_, durable, fields)

    def _emit(self, type_: str, durable: bool, fields: dict[str, Any]) -> dict:
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
            failure = write_line(self._echo, line)
            if failure is not None:
                self._echo = None
                if self._on_echo_closed is not None:
                    self._on_echo_closed(f"stdout {failure}")
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
