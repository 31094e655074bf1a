"""Progress of a download on stderr: a line at most once per second, for large files only."""

from __future__ import annotations

import time
from typing import TextIO

_MIB = float(1 << 20)


class DownloadProgress:
    """Progress lines on stderr for large files, at most one per second."""

    def __init__(self, label: str, size: int, min_bytes: int, stream: TextIO):
        self.label, self.size, self.stream = label, size, stream
        self.enabled = size >= min_bytes
        self.start = self.last = time.monotonic()

    def update(self, done: int, final: bool = False) -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        if not final and now - self.last < 1.0:
            return
        self.last = now
        rate = done / _MIB / max(now - self.start, 1e-9)
        percent = 100.0 * done / self.size if self.size else 100.0
        print(
            f"fetch {self.label}: {done / _MIB:.1f}/{self.size / _MIB:.1f} MiB "
            f"({percent:.0f}%) {rate:.1f} MiB/s",
            file=self.stream,
            flush=True,
        )
