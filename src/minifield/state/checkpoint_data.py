"""The data file of a one-process checkpoint: every state array in one file.

Layout (``arrays.bin``): the arrays in the manifest's order (name order), each array's bytes
in C order starting at an offset that is a multiple of :data:`ALIGNMENT`, zero bytes between
one array's end and the next offset, nothing after the last array. The manifest records,
for each array, ``name``, ``dtype`` (numpy's ``dtype.str``), ``shape``, ``offset``,
``nbytes`` and its integrity check (the field :data:`DIGEST` in format 5: the array's
version-3 digest, :func:`pieces.array_digest`; :data:`SHA256` in format 3: the sha256 of
those ``nbytes`` bytes), and, for the file, ``data: {file, size, alignment}``. There is no
header in the file: everything a reader needs is in the manifest, which is written (and
fsynced) after the data file. Format 4's part files (:mod:`.checkpoint_parts`) are written
the same way, each block checked by its sha256.

One file instead of one ``.npy`` per array: creating, writing and fsyncing 161 small files
cost a 39 MB state 6.8x the CPU of one raw write+fsync of its bytes; one file, written
sequentially and hashed on the same chunks, is one create and one fsync.
"""

from __future__ import annotations

import hashlib
import math
import mmap
import os
import queue
import threading
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from .. import atomic
from . import pieces, regions
from .arrays import array_sha256, byte_view

#: the data file's name inside a checkpoint directory
DATA_FILE = "arrays.bin"
#: an entry's integrity check, by field: the version-3 digest of the array (format 5: the
#: one the state hash is made of, so a commit at a hashed update hashes nothing), or the
#: sha256 of its bytes (format 3, and format 4's blocks)
DIGEST, SHA256 = "digest", "sha256"
#: every array starts at a multiple of this many bytes (a cache line; any dtype's alignment,
#: so an array can be viewed in place in a mapping of the file)
ALIGNMENT = 64
#: bytes hashed and written at a time (a chunk stays in cache between the two)
_CHUNK = 4 << 20
#: bytes one gathered write takes at most when the writing thread hashes none of them: the
#: thread waits for the GIL after each write (behind the hashing threads), so it writes in
#: few large calls
_BATCH = 64 << 20
#: buffers one ``writev`` takes at most (Linux's IOV_MAX)
_IOV_MAX = os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024
_ZEROS = bytes(ALIGNMENT)


class CheckpointError(Exception):
    """A checkpoint that cannot be trusted (missing, corrupt, or of another computation)."""


def _write_all(fd: int, buffers: list) -> None:
    """Write ``buffers`` at the file's position with as few system calls as the kernel
    allows (``writev``: up to ``IOV_MAX`` buffers each), finishing partial writes."""
    while buffers:
        done = os.writev(fd, buffers[:_IOV_MAX])
        while buffers and done >= len(buffers[0]):
            done -= len(buffers[0])
            buffers = buffers[1:]
        if done:
            buffers = [memoryview(buffers[0])[done:], *buffers[1:]]


def _single_piece(array: np.ndarray) -> bool:
    """Whether ``array`` is one hash piece: its version-3 digest is then the sha256 of its
    bytes' sha256 (``pieces.block_digests``), hashed on the chunks written."""
    return array.size == 0 or math.prod(pieces.piece_grid(array.shape)) == 1


class _Digests:
    """The version-3 digests of an unhashed commit's arrays, each started as the array
    reaches the writer: a one-piece array's from the sha256 of its bytes hashed on the chunks
    written (:meth:`one_piece`); arrays of large pieces on up to ``pieces.HASHERS`` threads,
    the others one after another on one more (``pieces.pooled``). None on the writing thread:
    the writes go on while every array is hashed (hashed there, the 125M state's arrays of
    1 KiB pieces held up its writes: docs/tpu.md)."""

    def __init__(self) -> None:
        self.pool = ThreadPoolExecutor(pieces.HASHERS, thread_name_prefix="checkpoint-pool")
        self.lane = ThreadPoolExecutor(1, thread_name_prefix="checkpoint-lane")
        self.jobs: dict[str, Any] = {}
        self.taker: threading.Thread | None = None
        self.closing = False

    def ahead(self, items: Iterable[tuple[str, np.ndarray]]):
        """``items`` as they come, taken on a thread of their own that starts each array's
        digest (one-piece arrays excepted: the writer hashes those on its chunks) as soon as
        the array is on the host, not when the writer reaches it: the hashing then runs
        beside the writes from the first array on (when each started at its turn, the last
        arrays' hashing came after the last write: docs/tpu.md)."""
        handed: queue.SimpleQueue = queue.SimpleQueue()

        def take() -> None:
            try:
                for name, array in items:
                    if self.closing:  # the write failed: hash and copy no more
                        break
                    if not _single_piece(array):
                        self.start(name, array)
                    handed.put((name, array))
            except BaseException as error:  # handed to the writer, which raises it
                handed.put(error)
                return
            handed.put(None)

        self.taker = threading.Thread(target=take, name="checkpoint-host-copies", daemon=True)
        self.taker.start()
        while (item := handed.get()) is not None:
            if isinstance(item, BaseException):
                raise item
            yield item

    def start(self, name: str, array: np.ndarray) -> None:
        count = math.prod(pieces.piece_grid(array.shape))
        threads = self.pool if pieces.pooled(array.nbytes, count) else self.lane
        self.jobs[name] = threads.submit(pieces.array_digest, array)

    def one_piece(self, name: str, sha256: bytes) -> None:
        self.jobs[name] = hashlib.sha256(sha256).hexdigest()

    def results(self) -> dict[str, str]:
        return {
            name: job if isinstance(job, str) else job.result() for name, job in self.jobs.items()
        }

    def close(self) -> None:
        self.closing = True
        if self.taker is not None:
            self.taker.join()
        for threads in (self.lane, self.pool):
            threads.shutdown(wait=True, cancel_futures=True)


def write(
    path: Path,
    items: Iterable[tuple[str, np.ndarray]],
    *,
    check: str,
    known: Mapping[str, str] | None = None,
) -> list[dict]:
    """Write ``items`` (``(name, host array)`` in name order, each taken only when its turn
    comes: a caller may still be copying the later ones to the host) as one data file at
    ``path`` and fsync it. Returns the manifest entries, each with its ``check`` field:
    :data:`SHA256`, the sha256 of its bytes; :data:`DIGEST`, its version-3 digest, taken
    from ``known`` (``{name: digest}``, when the caller hashed these very arrays: nothing is
    hashed here) or hashed meanwhile (:class:`_Digests`). An error names the file.

    The bytes go out in gathered writes (many small arrays in one system call, a large one in
    several) from the arrays' own memory: of about :data:`_CHUNK` where this thread hashes
    them (a sha256), each chunk just before it is written (still in cache); else of up to
    :data:`_BATCH`."""
    entries, position, batch, batched = [], 0, [], 0
    pending = _Digests() if check == DIGEST and known is None else None
    if pending is not None:
        items = pending.ahead(items)
    with atomic.naming(path):
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            for name, array in items:
                data = byte_view(array)
                padding = -position % ALIGNMENT
                if padding:
                    batch.append(_ZEROS[:padding])
                    position += padding
                sha256 = None
                if check == SHA256 or (pending is not None and _single_piece(array)):
                    sha256 = hashlib.sha256()
                size = _BATCH if sha256 is None else _CHUNK
                for start in range(0, data.size, size):
                    chunk = data[start : start + size]
                    if sha256 is not None:
                        sha256.update(chunk)
                    batch.append(chunk)
                    batched += chunk.size
                    if batched >= size:
                        _write_all(fd, batch)
                        batch, batched = [], 0
                entry = {
                    "name": name,
                    "dtype": array.dtype.str,
                    "shape": list(array.shape),
                    "offset": position,
                    "nbytes": data.size,
                }
                if check == SHA256:
                    entry[SHA256] = sha256.hexdigest()
                elif pending is not None and sha256 is not None:
                    pending.one_piece(name, sha256.digest())
                entries.append(entry)
                position += data.size
            _write_all(fd, batch)
            os.fsync(fd)
            if check == DIGEST:
                digests = known if pending is None else pending.results()
                for entry in entries:
                    entry[DIGEST] = digests[entry["name"]]
        finally:
            if pending is not None:
                pending.close()
            os.close(fd)
    return entries


def description(entries: list[dict]) -> dict:
    """The manifest's ``data`` field for a data file holding ``entries``."""
    size = entries[-1]["offset"] + entries[-1]["nbytes"] if entries else 0
    return {"file": DATA_FILE, "size": size, "alignment": ALIGNMENT}


def layout(manifest_path: Path, manifest: dict, check: str) -> list[tuple[dict, np.dtype, int]]:
    """``(entry, dtype, nbytes)`` of each array, after checking that the entries tile the data
    file as the format says (aligned, in order, not overlapping, sizes agreeing with the
    shapes, the last one ending at the file's size) and each holds its ``check`` field."""
    data = manifest.get("data")
    if not isinstance(data, dict) or data.get("file") != DATA_FILE:
        raise CheckpointError(f"{manifest_path}: field data.file must be {DATA_FILE!r}")
    if data.get("alignment") != ALIGNMENT:
        raise CheckpointError(f"{manifest_path}: field data.alignment must be {ALIGNMENT}")
    out, end = [], 0
    for index, entry in enumerate(manifest.get("arrays", [])):
        where = f"{manifest_path}: arrays[{index}]"
        try:
            if not isinstance(entry["name"], str) or not isinstance(entry[check], str):
                raise TypeError(f"name and {check} must be strings")
            dtype = np.dtype(entry["dtype"])
            shape, offset, nbytes = entry["shape"], entry["offset"], entry["nbytes"]
            count = math.prod(int(n) for n in shape)
        except (KeyError, TypeError, ValueError) as exc:
            raise CheckpointError(
                f"{where}: needs name, dtype (a numpy dtype), shape, offset, nbytes, {check} "
                f"({type(exc).__name__}: {exc})"
            ) from exc
        if dtype.hasobject:
            raise CheckpointError(
                f"{where} ({entry.get('name')!r}): dtype {dtype.str} holds Python objects, "
                "expected a plain numeric dtype"
            )
        if count * dtype.itemsize != nbytes:
            raise CheckpointError(
                f"{where} ({entry.get('name')!r}): nbytes {nbytes} is not the size of "
                f"{dtype.str}{shape} ({count * dtype.itemsize})"
            )
        if not isinstance(offset, int) or offset < end or offset % ALIGNMENT:
            raise CheckpointError(
                f"{where} ({entry.get('name')!r}): offset {offset!r} must be a multiple of "
                f"{ALIGNMENT} at or after the previous array's end ({end})"
            )
        out.append((entry, dtype, nbytes))
        end = offset + nbytes
    if data.get("size") != end:
        raise CheckpointError(
            f"{manifest_path}: field data.size {data.get('size')!r} is not where the last "
            f"array ends ({end})"
        )
    return out


def blocks(manifest_path: Path, manifest: dict, check: str) -> dict:
    """The data file as stored blocks, one per array (the whole array), for a restore that
    reads regions of them (``checkpoint_parts.read_arrays``); a block's sha256 only where
    the entries record it (format 3: an array read whole is otherwise checked by its
    digest, and one read in regions by the state hash once placed)."""
    out = {}
    for entry, dtype, nbytes in layout(manifest_path, manifest, check):
        shape = tuple(entry["shape"])
        block = regions.Stored(
            regions.whole(shape), DATA_FILE, entry["offset"], nbytes, entry.get(SHA256)
        )
        out[entry["name"]] = (dtype, shape, [block])
    return out


def read(path: Path, manifest_path: Path, manifest: dict, check: str) -> dict[str, np.ndarray]:
    """Every array of a one-file checkpoint directory ``path``, from a read-only mapping of its
    data file, each copied out and checked against its entry's ``check`` field (the copy is
    what is hashed, so the bytes verified are the bytes used): a sha256 as each is copied, a
    version-3 digest once all are (arrays of large pieces on threads); the bytes between
    arrays must be zero and the file exactly the recorded size."""
    entries = layout(manifest_path, manifest, check)
    file = path / DATA_FILE
    arrays: dict[str, np.ndarray] = {}
    try:
        with open(file, "rb") as handle:
            size = os.fstat(handle.fileno()).st_size
            if size != manifest["data"]["size"]:
                raise CheckpointError(
                    f"{file}: truncated or extended: {size} bytes, the manifest says "
                    f"{manifest['data']['size']}"
                )
            mapped = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) if size else b""
            try:
                end = 0
                for entry, dtype, nbytes in entries:
                    # sliced as bytes (a copy of < ALIGNMENT bytes): no view of the mapping
                    # outlives this statement, so an error below can still close it
                    if mapped[end : entry["offset"]].strip(b"\0"):
                        raise CheckpointError(
                            f"{file}: non-zero bytes before state array {entry['name']!r}"
                        )
                    array = np.empty(entry["shape"], dtype)
                    byte_view(array)[:] = np.frombuffer(mapped, np.uint8, nbytes, entry["offset"])
                    if check == SHA256 and array_sha256(array) != entry[SHA256]:
                        raise CheckpointError(_mismatch(file, SHA256, entry))
                    arrays[entry["name"]] = array
                    end = entry["offset"] + nbytes
            finally:
                if size:
                    mapped.close()
    except OSError as exc:
        raise CheckpointError(f"{file}: unreadable ({exc})") from exc
    if check == DIGEST:
        digests = pieces.host_digests(arrays)
        for entry, _dtype, _nbytes in entries:
            if digests[entry["name"]] != entry[DIGEST]:
                raise CheckpointError(_mismatch(file, DIGEST, entry))
    return arrays


def _mismatch(file: Path, check: str, entry: dict) -> str:
    end = entry["offset"] + entry["nbytes"]
    return (
        f"{file}: {check} mismatch for state array {entry['name']!r} (bytes "
        f"{entry['offset']}-{end})"
    )
