"""Exclusive file locks that end with their holder: the one lock behind the store's single
writer, the GPU leases and a computation's one-attempt-at-a-time training lock.

A lock is an exclusive ``fcntl.flock`` on a lock file. The kernel releases a flock when
the last descriptor of the open file is closed, so a lock ends however its holder ends —
normal exit, exception, SIGKILL — and a crashed holder never leaves it taken. A descriptor
handed to a child process (``pass_fds``, after ``os.set_inheritable``) keeps the lock taken
for as long as the child runs, even if the process that took it dies first.

The file's content (one JSON line) says who holds the lock, for people and error messages;
the lock itself is only the flock.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import time
from collections.abc import Iterator, Mapping
from pathlib import Path

from .. import atomic


class LockTimeout(Exception):
    """The lock stayed held by another process for longer than the caller would wait."""

    def __init__(self, path: Path, holder: str, waited_s: float):
        self.path, self.holder, self.waited_s = Path(path), holder, waited_s
        super().__init__(f"{path} is held by {holder}; gave up after {waited_s:g} s")


def try_lock(path: str | Path, holder: Mapping[str, object]) -> int | None:
    """Take the lock on ``path`` (created if needed) without waiting.

    Returns the descriptor that holds it (close it to release), or None when another
    process holds it. On success the file is rewritten to name ``holder``.
    """
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    except BaseException:
        os.close(fd)
        raise
    try:
        with atomic.naming(path):  # a full disk: the error names the lock file
            os.ftruncate(fd, 0)
            os.pwrite(fd, (json.dumps(holder) + "\n").encode(), 0)
    except BaseException:
        os.close(fd)
        raise
    return fd


def holder_of(path: str | Path) -> str:
    """What the lock file says about its holder ("unknown" when it says nothing)."""
    try:
        text = Path(path).read_text(encoding="utf-8", errors="replace").strip()
    except OSError:
        text = ""
    return text or "unknown"


def acquire(
    path: str | Path,
    holder: Mapping[str, object],
    *,
    timeout_s: float | None,
    poll_s: float = 0.05,
) -> int:
    """Take the lock on ``path``, waiting up to ``timeout_s`` seconds (None: forever).

    Polls rather than blocking in ``flock`` so that the wait is bounded and a signal
    handler can run between tries. Raises :class:`LockTimeout` naming the holder.
    """
    started = time.monotonic()
    while True:
        fd = try_lock(path, holder)
        if fd is not None:
            return fd
        waited = time.monotonic() - started
        if timeout_s is not None and waited >= timeout_s:
            raise LockTimeout(Path(path), holder_of(path), timeout_s)
        time.sleep(poll_s)


@contextlib.contextmanager
def held(
    path: str | Path,
    holder: Mapping[str, object],
    *,
    timeout_s: float | None,
    poll_s: float = 0.05,
) -> Iterator[int]:
    """:func:`acquire` as a context manager; the lock is released on any exit."""
    fd = acquire(path, holder, timeout_s=timeout_s, poll_s=poll_s)
    try:
        yield fd
    finally:
        os.close(fd)
