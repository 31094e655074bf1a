"""State-hash version 3: each array hashed in canonical pieces, where its shards live.

The pieces of an array depend on its shape alone. Along each axis of size ``n`` the array
is cut into ``gcd(n, PIECE_GRID)`` equal blocks (an axis of size 0 makes the whole array one
empty piece; a scalar is one piece); a piece is one block of that grid, its bytes in C
order. The array's digest is the sha256 of its pieces' sha256 digests (32 bytes each)
concatenated in C order of the grid; the digests are all a process exchanges
(:func:`state_digests`). The values decide the digest, not the placement: one device, a
replicated mesh, a sharded mesh over one or several processes all give the same one.

A data-parallel mesh of ``N`` devices splits an array along one axis of size ``n`` into
``N`` equal shards. When ``N`` divides ``gcd(n, PIECE_GRID)`` every shard is a union of whole
pieces and is hashed where it lives. When it does not (32 devices and more on an axis of
``16k``, or 5), shards cut pieces: they are merged into blocks of whole pieces
(:func:`.regions.merged`), and a process holding every shard of a block puts that block
together from its own shards (a copy of the block, never of the array) and hashes it. The
pieces themselves stay those of this grid whatever the device count (a finer grid would be
other pieces, so other digests). An array with a piece that no process holds all of (its
shards on several processes, e.g. 32 processes × 1 device on an axis of 64) is laid out
again over its devices so that each process holds whole pieces (:func:`.regions.regrouped`:
a device then holds a few times its shard); only a layout that cannot be (not split along
one axis of a 1-D mesh) is copied to every process whole (``arrays.to_host``) and hashed
there: the one case that still gathers an array.
"""

from __future__ import annotations

import hashlib
import math
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from . import regions

#: pieces along an axis of size n: gcd(n, PIECE_GRID). The pieces define the digests, so
#: another grid changes the hash; a finer one also costs a sha256 call per piece
#: (docs/training-loop.md, "Why pieces")
PIECE_GRID = 48
#: pieces of at least this many bytes are copied (when not contiguous) and hashed one at a
#: time; smaller ones a row of pieces at a time, which is cheaper per piece
LARGE_PIECE = 64 << 10
#: a block of small pieces up to this size is reordered by one copy of it all, a larger one a
#: row of pieces at a time (a copy per row costs more calls, a copy of it all more memory)
WHOLE_COPY = 1 << 20
#: bytes of one piece digest (sha256)
DIGEST_BYTES = 32
#: threads hashing arrays of large pieces at once (hashlib and numpy's copies release the
#: GIL): 4, up to 8 where the host has the cores. The digests do not depend on the count.
HASHERS = max(4, min(8, os.cpu_count() or 1))


def piece_grid(shape: Sequence[int]) -> tuple[int, ...]:
    """Pieces along each axis of an array of ``shape``."""
    if any(n == 0 for n in shape):
        return tuple(1 for _ in shape)
    return tuple(math.gcd(int(n), PIECE_GRID) for n in shape)


_SCRATCH = threading.local()
#: copies larger than this are not kept for reuse (a whole array of one piece can be large)
_SCRATCH_MAX = 16 << 20


def _in_order(view: np.ndarray) -> np.ndarray:
    """``view``'s elements in C order: ``view`` itself when it is already, else a copy in this
    thread's scratch buffer (grown to the largest copy asked for, up to :data:`_SCRATCH_MAX`,
    then reused), valid until the thread's next call: no allocation per piece. (On the chip's
    host a commit's hashing threads take system time that grows with their number, docs/tpu.md,
    "Checkpoints on the chip"; the device check's checkpoint section commits with and without
    this reuse to tell whether allocation is that time. On this CPU both hash at the same
    speed.)"""
    if view.flags.c_contiguous:
        return view
    if view.nbytes > _SCRATCH_MAX:
        return np.ascontiguousarray(view)
    buffer = getattr(_SCRATCH, "buffer", None)
    if buffer is None or buffer.nbytes < view.nbytes:
        buffer = _SCRATCH.buffer = np.empty(view.nbytes, np.uint8)
    out = buffer[: view.nbytes].view(view.dtype).reshape(view.shape)
    np.copyto(out, view)
    return out


def block_digests(block: np.ndarray, counts: Sequence[int]) -> bytes:
    """The concatenated sha256 digests of the pieces of ``block``, which holds ``counts[a]``
    whole pieces along axis ``a``, in C order of those pieces."""
    block = np.asarray(block)
    total = math.prod(counts)
    if block.size == 0 or total == 1:
        return hashlib.sha256(_in_order(block).reshape(-1).view(np.uint8)).digest()
    sizes = [s // c for s, c in zip(block.shape, counts, strict=True)]
    if math.prod(sizes) * block.itemsize >= LARGE_PIECE:
        # large pieces one at a time: a copy holds one piece (none when it is contiguous)
        sha256 = hashlib.sha256
        return b"".join(
            sha256(
                _in_order(
                    block[tuple(slice(i * z, (i + 1) * z) for i, z in zip(at, sizes, strict=True))]
                ).reshape(-1).view(np.uint8)
            ).digest()
            for at in np.ndindex(*counts)
        )  # fmt: skip
    if counts[0] > 1 and math.prod(counts[1:]) > 1 and block.nbytes > WHOLE_COPY:
        # one row of pieces at a time (the first axis is the grid's outermost, so their
        # digests follow in C order): the copy below holds one row, never the whole block
        rows = block.shape[0] // counts[0]
        return b"".join(
            block_digests(block[i * rows : (i + 1) * rows], (1, *counts[1:]))
            for i in range(counts[0])
        )
    interleaved = [d for pair in zip(counts, sizes, strict=True) for d in pair]
    ndim = len(counts)
    order = list(range(0, 2 * ndim, 2)) + list(range(1, 2 * ndim, 2))
    # one copy puts every piece's bytes in a row (none when only the first axis is cut)
    data = memoryview(_in_order(block.reshape(interleaved).transpose(order))).cast("B")
    step = len(data) // total
    sha256 = hashlib.sha256
    return b"".join([sha256(data[i : i + step]).digest() for i in range(0, len(data), step)])


def array_digest(array: np.ndarray) -> str:
    """The version-3 digest of one host array (all its pieces here)."""
    array = np.asarray(array)
    return hashlib.sha256(block_digests(array, piece_grid(array.shape))).hexdigest()


def on_threads(jobs: Sequence[Any], run: Callable[[Any], Any], pool: Callable[[Any], bool]):
    """``[run(job) for job in jobs]``, the jobs ``pool`` says (:func:`pooled`) on up to
    ``HASHERS`` threads while this thread runs the others."""
    pooled = [i for i, job in enumerate(jobs) if pool(job)]
    if len(pooled) < 2:
        return [run(job) for job in jobs]
    results: list[Any] = [None] * len(jobs)
    with ThreadPoolExecutor(max_workers=min(HASHERS, len(pooled))) as pool:
        futures = {i: pool.submit(run, jobs[i]) for i in pooled}
        for i, job in enumerate(jobs):
            if i not in futures:
                results[i] = run(job)
        for i, future in futures.items():
            results[i] = future.result()
    return results


def pooled(nbytes: int, pieces: int) -> bool:
    """Whether an array of ``pieces`` equal pieces of ``nbytes`` in all is hashed on the
    hashing threads: pieces of at least ``LARGE_PIECE``, each sha256 call then holding the
    GIL for a moment in ~50 µs of hashing without it.

    An array of smaller pieces is hashed on one thread: its pieces hold the GIL from one
    sha256 call to the next (hashlib releases it only in a call of at least 2,048 bytes,
    CPython's ``HASHLIB_GIL_MINSIZE``), so several threads hashing such arrays only take
    turns at it and add their hand-overs (a futex wake-up each, beside the few µs a 7 KiB
    piece is hashed without it), and a thread that needs the GIL back (a checkpoint's
    writer, after each write) waits behind them (docs/performance.md).
    """
    return pieces > 0 and nbytes >= LARGE_PIECE * pieces


def host_digests(arrays: dict[str, np.ndarray]) -> dict[str, str]:
    """``{name: array_digest}`` of named host arrays, arrays of large pieces hashed at once."""
    names = sorted(arrays)
    digests = on_threads(
        names,
        lambda name: array_digest(arrays[name]),
        lambda name: pooled(arrays[name].nbytes, math.prod(piece_grid(arrays[name].shape))),
    )
    return dict(zip(names, digests, strict=True))


def _blocks(leaf: Any, cell: Sequence[int]) -> dict[tuple, set[int]]:
    """``{block: processes holding all of it}`` of an array: its shards merged into blocks of
    whole pieces of size ``cell`` (:func:`.regions.merged`)."""
    held = regions.distinct(leaf)
    if len(held) == 1:  # the whole array (one device, replicated, a host value)
        return held
    return regions.merged(held, tuple(leaf.shape), cell)


def dealt(leaves: Sequence[tuple[str, Any]], whole: Callable[[Any], np.ndarray], here: int):
    """What process ``here`` hashes of ``(name, array)`` pairs, and who hashes the rest:
    ``(offsets, owners, jobs)`` — each array's first row in the table of piece digests and
    its piece count, the process hashing each of its pieces, and this process's jobs
    ``(first row, pieces along each axis, rows of its pieces, block)``."""
    dealer = regions.Dealer()
    offsets, owners, jobs = [], [], []
    total = 0
    for _name, leaf in leaves:
        shape = tuple(leaf.shape)
        grid = piece_grid(shape)
        count = math.prod(grid)
        offsets.append((total, count))
        cell = [n // g for n, g in zip(shape, grid, strict=True)]  # a piece's size
        blocks = _blocks(leaf, cell)
        if not all(blocks.values()):
            # pieces that lie across processes: the array laid out again so that each
            # process holds whole pieces, else gathered whole (a collective either way, in
            # this order everywhere)
            again = regions.regrouped(leaf, cell)
            leaf = whole(leaf) if again is None else again
            blocks = _blocks(leaf, cell)
        owner = np.zeros(count, np.int32)
        numbering = np.arange(count).reshape(grid)
        for block, processes in sorted(blocks.items()):
            chosen = dealer.holder(processes)
            # the block's pieces along each axis (an empty array is one piece)
            ranges = [
                (a // c, b // c) if c else (0, 1) for (a, b), c in zip(block, cell, strict=True)
            ]
            flat = numbering[tuple(slice(a, b) for a, b in ranges)].reshape(-1)
            owner[flat] = chosen
            if chosen == here:
                counts = [b - a for a, b in ranges]
                jobs.append((total, counts, flat, regions.value_of(leaf, block)))
        owners.append(owner)
        total += count
    return offsets, owners, jobs


def state_digests(
    leaves: Sequence[tuple[str, Any]], whole: Callable[[Any], np.ndarray]
) -> dict[str, str]:
    """``{name: array_digest}`` of ``(name, array)`` pairs wherever the arrays live.

    A collective when any array spans processes (every process calls it with the same
    names in the same order): each block of whole pieces is hashed by one process holding
    it (:func:`dealt`, :class:`.regions.Dealer`), put together from that process's shards
    when they cut its pieces; then the processes exchange the digests — ``32 × pieces``
    bytes, never an array. ``whole(array)`` copies to every process an array with a piece
    that no process holds all of and that :func:`.regions.regrouped` cannot lay out again
    (``arrays.to_host``).
    """
    import jax

    offsets, owners, jobs = dealt(leaves, whole, jax.process_index())
    total = sum(count for _, count in offsets)
    table = np.zeros((total, DIGEST_BYTES), np.uint8)

    def run(job) -> None:
        start, counts, flat, value = job
        value = value if isinstance(value, np.ndarray) else np.asarray(jax.device_get(value))
        digests = np.frombuffer(block_digests(value, counts), np.uint8).reshape(-1, DIGEST_BYTES)
        table[start + flat] = digests

    on_threads(jobs, run, lambda job: pooled(job[3].nbytes, math.prod(job[1])))

    if jax.process_count() > 1 and total:
        from jax.experimental import multihost_utils

        gathered = np.asarray(multihost_utils.process_allgather(table))
        table = gathered[np.concatenate(owners), np.arange(total)]
    return {
        name: hashlib.sha256(table[start : start + count].tobytes()).hexdigest()
        for (name, _leaf), (start, count) in zip(leaves, offsets, strict=True)
    }
