"""Atomic file writes: temporary file in the same directory, fsync, rename, fsync the directory.

A reader never sees a half-written file: it sees the old content or the new one. A write that
fails names the file (:func:`naming`), and :func:`is_io_failure` tells a full or failing disk
from a bad request.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

#: errno values that say the output could not be stored, not that the request was wrong: a
#: full disk, an exhausted quota, a file-size limit, a read-only or failing device
IO_FAILURE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS, errno.EIO})


def is_io_failure(exc: BaseException | None) -> bool:
    """Whether ``exc``, or an exception it was raised from, is an OSError of
    :data:`IO_FAILURE_ERRNOS` (a wrapper such as a failed checkpoint write keeps its cause)."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, OSError) and exc.errno in IO_FAILURE_ERRNOS:
            return True
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return False


def io_refusal(write: Callable[[], object]) -> OSError | None:
    """Run ``write``; an I/O failure it meets (the disk refused it) is returned, not raised."""
    try:
        write()
    except OSError as exc:
        if not is_io_failure(exc):
            raise
        return exc
    return None


@contextlib.contextmanager
def naming(path: str | Path) -> Iterator[None]:
    """Re-raise an OSError that names no file (``write``, ``fsync``: ``[Errno 28] No space
    left on device``) as the same error naming ``path``."""
    try:
        yield
    except OSError as exc:
        if exc.filename is None:
            raise OSError(exc.errno, exc.strerror, str(path)) from exc
        raise


def fsync_dir(path: str | Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_bytes(path: str | Path, data: bytes) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with naming(path):
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        try:
            with os.fdopen(fd, "wb") as handle:
                handle.write(data)
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(tmp, path)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise
        fsync_dir(path.parent)


def json_bytes(value: Any) -> bytes:
    """The bytes ``write_json`` writes for ``value``."""
    return (json.dumps(value, indent=2, sort_keys=True, allow_nan=False) + "\n").encode()


def write_json(path: str | Path, value: Any) -> None:
    write_bytes(path, json_bytes(value))


def read_json(path: str | Path) -> Any:
    with open(path, encoding="utf-8") as handle:
        return json.load(handle)
