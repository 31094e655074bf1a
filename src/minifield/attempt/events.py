"""The attempt's event stream: one JSON object per line, contiguous ``seq``, wall and monotonic time.

Each event goes to ``events.jsonl`` (flushed per line; fsynced at durable
moments) and to stdout, so a supervisor can follow a worker live. The file is the
record; stdout is a courtesy: when its reader goes away (``minifield-worker ... | head``,
a supervisor that died), echoing stops, the events file carries on, and the log tells
whoever asked (``on_echo_closed``) so that the attempt can end cleanly.

A line reaches the file whole or not at all: it is appended with ``os.write`` on an
``O_APPEND`` descriptor, and a write that fails part-way (a full disk, a file-size limit)
is cut back to the previous whole line before the error, naming the file, is raised. A file
found ending in a torn line (a machine that went down mid-write) is cut back to its last
whole line before anything is appended to it (:func:`repair_tail`).
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

from .. import atomic


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


#: ``EventLog``'s default echo: this process's ``sys.stdout`` when the log is made (a default
#: of ``sys.stdout`` itself is bound once, at import, to whatever stream stood there then)
STDOUT: Any = object()


class EventLog:
    """Appends events to ``path`` and echoes them to ``echo``.

    With ``path=None`` and ``echo=None`` it writes nothing at all: what the processes
    of a multi-process attempt other than process 0 use, so that one ``events.jsonl``
    and one stdout stream describe the attempt.
    """

    def __init__(
        self,
        path: Path | None,
        echo: TextIO | None = STDOUT,
        on_echo_closed: Callable[[str], None] | None = None,
    ):
        self.path = path
        self._fd: int | None = None
        #: bytes of whole lines in the file: where a failed append is cut back to
        self._length = 0
        if path is not None:
            with atomic.naming(path):
                self._fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o644)
                self._length = repair_tail(self._fd)
        self._echo = sys.stdout if echo is STDOUT else echo
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
        if self._fd is not None:
            self._append((line + "\n").encode())
            if durable:
                with atomic.naming(self.path):
                    os.fsync(self._fd)
        if self._echo is not None:
            failure = write_line(self._echo, line)
            if failure is not None:
                self._echo = None
                if self._on_echo_closed is not None:
                    self._on_echo_closed(f"stdout {failure}")
        self._seq += 1
        return event

    def _append(self, data: bytes) -> None:
        """Append one whole line, or nothing: on an error the file is cut back to the last
        whole line, then the error (naming the file) is raised."""
        written = 0
        try:
            with atomic.naming(self.path):
                while written < len(data):
                    # a short count means the disk filled mid-line: the next write says why
                    written += os.write(self._fd, data[written:])
        except OSError:
            if written:
                try:
                    os.ftruncate(self._fd, self._length)
                except OSError:
                    pass  # the error being raised says why; a reader skips the torn line
            raise
        self._length += written

    def close(self) -> None:
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        try:
            with atomic.naming(self.path):
                os.fsync(fd)
        finally:
            os.close(fd)


def repair_tail(fd: int) -> int:
    """Cut the file open on ``fd`` back to its last whole line (ending in a newline); returns
    its length. A torn last line is the part of an event a machine crash left behind: the
    event was never completely written, so it never happened."""
    length = os.fstat(fd).st_size
    if length == 0 or os.pread(fd, 1, length - 1) == b"\n":
        return length
    whole, end = 0, length
    while end > 0 and not whole:
        start = max(0, end - (1 << 16))
        newline = os.pread(fd, end - start, start).rfind(b"\n")
        whole = start + newline + 1 if newline >= 0 else 0
        end = start
    os.ftruncate(fd, whole)
    return whole


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
