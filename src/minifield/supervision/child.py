"""The supervised child, as the supervisor sees it: its two output streams (stdout parsed
into events and malformed lines, stderr kept as a tail; both also written to capped logs)
and its process group, signalled as a whole, with the supervisor's own SIGINT/SIGTERM
forwarded to it."""

from __future__ import annotations

import collections
import json
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any


class CappedLog:
    """A log file that stops growing at ``limit`` bytes and says how much it dropped."""

    def __init__(self, path: Path, limit: int):
        self.path = path
        self.limit = limit
        self.written = 0
        self.dropped = 0
        self._handle = open(path, "wb")

    def write(self, data: bytes) -> None:
        room = self.limit - self.written
        if room > 0:
            chunk = data[:room]
            self._handle.write(chunk)
            self._handle.flush()
            self.written += len(chunk)
        self.dropped += max(0, len(data) - max(room, 0))

    def close(self) -> None:
        if self.dropped:
            self._handle.write(f"\n[log capped: {self.dropped} more bytes not kept]\n".encode())
        self._handle.close()


class StdoutReader(threading.Thread):
    """Parses the child's stdout into events and malformed lines (both bounded)."""

    def __init__(
        self,
        stream,
        log: CappedLog,
        max_events: int,
        max_malformed: int,
        preempt_after_step: int | None = None,
    ):
        super().__init__(daemon=True)
        self.stream = stream
        self.log = log
        self.events: collections.deque = collections.deque(maxlen=max_events)
        self.events_total = 0
        self.malformed: list[dict] = []
        self.malformed_total = 0
        self.max_malformed = max_malformed
        self.types_seen: set[str] = set()
        self.terminal: dict | None = None  # last completed/failed/preempted/limit_reached event
        self.last_activity = time.monotonic()
        self.preempt_after_step = preempt_after_step
        self.preempt_cue: float | None = None  # when update ``preempt_after_step`` was seen

    def run(self) -> None:
        number = 0
        while True:
            line = self.stream.readline(1 << 20)
            if not line:
                break
            number += 1
            self.log.write(line)
            text = line.decode("utf-8", errors="replace").rstrip("\n")
            if not text.strip():
                continue
            try:
                value = json.loads(text)
            except ValueError:
                value = None
            if isinstance(value, dict) and isinstance(value.get("type"), str):
                self.last_activity = time.monotonic()
                self.events.append(value)
                self.events_total += 1
                self.types_seen.add(value["type"])
                if value["type"] in ("completed", "failed", "preempted", "limit_reached"):
                    self.terminal = value
                if (
                    self.preempt_cue is None
                    and value["type"] == "update"
                    and value.get("step") == self.preempt_after_step
                ):
                    self.preempt_cue = self.last_activity
            else:
                self.malformed_total += 1
                if len(self.malformed) < self.max_malformed:
                    self.malformed.append({"line": number, "text": text[:2000]})
        self.stream.close()


class StderrReader(threading.Thread):
    def __init__(self, stream, log: CappedLog, tail_bytes: int):
        super().__init__(daemon=True)
        self.stream = stream
        self.log = log
        self.tail: collections.deque = collections.deque()
        self.tail_size = 0
        self.tail_bytes = tail_bytes
        self.total = 0

    def run(self) -> None:
        while True:
            chunk = self.stream.read1(65536) if hasattr(self.stream, "read1") else b""
            if not chunk:
                break
            self.total += len(chunk)
            self.log.write(chunk)
            self.tail.append(chunk)
            self.tail_size += len(chunk)
            while self.tail_size - len(self.tail[0]) >= self.tail_bytes:
                self.tail_size -= len(self.tail.popleft())
        self.stream.close()

    def text(self) -> str:
        return b"".join(self.tail)[-self.tail_bytes :].decode("utf-8", errors="replace")


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def signal_group(pgid: int, sig: int) -> bool:
    try:
        os.killpg(pgid, sig)
        return True
    except ProcessLookupError:
        return False


class SignalForwarder:
    """Forward SIGINT/SIGTERM received by this process to the child's group (main thread only)."""

    def __init__(self) -> None:
        self.received: list[dict] = []
        self.pgid: int | None = None
        self._previous: dict[int, Any] = {}

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum, _frame) -> None:
        self.received.append(
            {"signal": signal.Signals(signum).name, "mono": time.monotonic(), "time": time.time()}
        )
        if self.pgid is not None:
            signal_group(self.pgid, signum)

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
