"""Safetensors files written by the processes that hold the tensors: an export of a state
sharded over several processes, with no tensor gathered into one process (``.npy`` files
likewise, :func:`npy_layout`).

The files are byte for byte the ones the ``safetensors`` library writes from the whole tensors
(:func:`header` lays them out as it does: ``__metadata__`` first, the tensors sorted by name,
compact JSON padded with spaces to 8 bytes, the data in that order). :func:`write` is a
collective of the processes of ``group`` (every process calls it with the same arguments):

1. process 0 creates each file with its header written and its size set (``ftruncate``);
2. every process writes, with ``os.pwrite``, the byte ranges of the slices its devices hold:
   each distinct slice of an array (a shard, or a replicated array's one copy) by one of the
   processes holding it, chosen by :class:`minifield.state.regions.Dealer` so replicated
   arrays are dealt out over the processes (as checkpoints and the state hash deal theirs); a
   slice is converted
   to the stored dtype by itself (elementwise, the bits of converting the whole tensor) and
   laid into the tensor's C order: a slice of whole trailing axes is one range, a slice of
   columns (a sharded matrix stored transposed) one range per row; then it ``fsync``\\s;
3. the processes agree that every part is durable (:func:`agree`; a failure anywhere is
   raised in every process, naming the process), and only then does process 0 go on (the
   index, ``config.json``, the commit by rename: :func:`minifield.state.export.write_whole`).

One process writing whole tensors (an export on one host, :func:`write_streamed`) lays the
file out the same way and writes each tensor into it as soon as it is made.

The output root is a file system every process sees (a cluster's shared one,
docs/cluster.md); writes go through ``pwrite`` of disjoint byte ranges, never a shared
memory map (which writes back whole pages).
"""

from __future__ import annotations

import json
import math
import os
import struct
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .. import atomic
from ..state import regions

#: safetensors' names of the stored dtypes
DTYPE_NAMES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}


def stored_type(dtype: str):
    """The NumPy type of a stored dtype's name (``ml_dtypes``' for ``bfloat16``)."""
    import ml_dtypes

    return {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}[dtype]


@dataclass(frozen=True)
class Source:
    """Where values of a stored tensor come from: ``leaf`` (a device array in any sharding, or
    a host array every process holds) in this project's layout; ``lead``: an index into its
    first axis (one expert of stacked adapters; None: the whole leaf); ``column``: where its
    columns start in the tensor before transposing (a fused matrix's part); ``transpose``:
    whether the tensor stores the transpose (HF's ``[out, in]``)."""

    leaf: Any
    lead: int | None = None
    column: int = 0
    transpose: bool = False


@dataclass(frozen=True)
class Tensor:
    """One stored tensor: its shape and the sources that fill it."""

    shape: tuple[int, ...]
    sources: tuple[Source, ...]


def header(shapes: dict[str, Sequence[int]], dtype: str, metadata: dict[str, str]):
    """``(header bytes, {name: data offset in the file}, file size)`` of a safetensors file of
    tensors of ``shapes``, all of ``dtype`` (a name of :data:`DTYPE_NAMES`), as the
    ``safetensors`` library lays one out (``metadata``: one entry, as the exports have; the
    library orders several as its hash map happens to)."""
    itemsize = np.dtype(stored_type(dtype)).itemsize
    entries: dict = {"__metadata__": metadata}
    position, offsets = 0, {}
    for name in sorted(shapes):
        size = math.prod(shapes[name]) * itemsize
        entries[name] = {
            "dtype": DTYPE_NAMES[dtype],
            "shape": [int(n) for n in shapes[name]],
            "data_offsets": [position, position + size],
        }
        offsets[name] = position
        position += size
    text = json.dumps(entries, separators=(",", ":"), ensure_ascii=False).encode()
    text += b" " * (-len(text) % 8)
    head = struct.pack("<Q", len(text)) + text
    return head, {name: len(head) + at for name, at in offsets.items()}, len(head) + position


def _placed(source: Source, ranges: tuple, value: np.ndarray):
    """``(start of the block in the stored tensor, the block)`` of a slice of the source's
    leaf (``ranges``: where it lies in the leaf), or None when it holds none of the tensor
    (another expert's)."""
    if source.lead is not None:
        start, stop = ranges[0]
        if not start <= source.lead < stop:
            return None
        value, ranges = value[source.lead - start], ranges[1:]
    starts = [start for start, _ in ranges]
    if starts:
        starts[-1] += source.column  # the columns of a fused matrix's part
    if source.transpose:
        value, starts = value.T, starts[::-1]
    return tuple(starts), value


def write_block(fd: int, offset: int, shape: tuple, starts: tuple, block: np.ndarray) -> None:
    """Write ``block`` (already in the stored dtype) into the C-order tensor of ``shape`` whose
    data starts at byte ``offset`` of the file ``fd``, at ``starts``: one ``pwrite`` per run
    of contiguous bytes (the block's trailing axes that span the tensor's whole make one)."""
    block = np.ascontiguousarray(block)
    if block.size == 0:
        return
    ndim = len(shape)
    strides = [math.prod(shape[a + 1 :]) for a in range(ndim)]
    # axes from ``cut`` on form one run each: all whole but possibly axis ``cut`` itself
    cut = 0
    for axis in range(ndim - 1, -1, -1):
        if block.shape[axis] != shape[axis]:
            cut = axis
            break
    base = sum(starts[a] * strides[a] for a in range(cut, ndim))
    raw = block.view(np.uint8)  # bytes (BF16 has no buffer format of its own)
    for lead in np.ndindex(*block.shape[:cut]):
        at = base + sum((starts[a] + i) * strides[a] for a, i in enumerate(lead))
        data = memoryview(np.ascontiguousarray(raw[lead])).cast("B")
        position = offset + at * block.itemsize
        while len(data):  # pwrite may write less than asked
            written = os.pwrite(fd, data, position)
            data, position = data[written:], position + written


class _Descriptor:
    """A file descriptor the pool's threads write through, closed only once no thread is
    writing and never written after: a task still running when the writer was interrupted
    (^C, even inside ``submit``, whose future the writer never got) skips its write, where it
    could otherwise have written into whatever file took the descriptor's number next."""

    def __init__(self, fd: int):
        self.fd, self._writing, self._closed = fd, 0, False
        self._changed = threading.Condition()

    def write(self, offset: int, block: np.ndarray) -> None:
        with self._changed:
            if self._closed:
                return
            self._writing += 1
        try:
            write_block(self.fd, offset, tuple(block.shape), (0,) * block.ndim, block)
        finally:
            with self._changed:
                self._writing -= 1
                self._changed.notify_all()

    def close(self) -> None:
        with self._changed:
            self._closed = True
            self._changed.wait_for(lambda: not self._writing)
        os.close(self.fd)


def write_streamed(
    path: Path, shapes: dict, dtype: str, metadata: dict[str, str], produce, pool
) -> None:
    """One process's safetensors file of whole tensors of ``shapes`` stored as ``dtype``, laid
    out as :func:`header` lays it out, each tensor ``produce(name)`` (in that dtype, of its
    shape) made by one of ``pool``'s threads and written at its offset as soon as it is made,
    then dropped: the process holds the tensors being made, never the file's. Written under a
    temporary name, fsynced and renamed (an interrupted write leaves no half-written file);
    an OSError names ``path``."""
    import tempfile
    from concurrent.futures import wait

    head, offsets, size = header(shapes, dtype, metadata)

    def put(out: _Descriptor, name: str) -> None:
        block = produce(name)
        if tuple(block.shape) != tuple(shapes[name]):
            raise ValueError(f"{path}: tensor {name} has shape {block.shape}, not {shapes[name]}")
        out.write(offsets[name], block)

    with atomic.naming(path):
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        out, futures = _Descriptor(fd), []
        try:
            try:
                out.write(0, np.frombuffer(head, np.uint8))
                os.ftruncate(fd, size)
                for name in shapes:
                    futures.append(pool.submit(put, out, name))
                wait(futures)
                for future in futures:
                    future.result()  # the first failure, in the tensors' order
                os.fsync(fd)
            finally:
                for future in futures:  # interrupted: what has not started never will
                    future.cancel()
                out.close()
            os.replace(tmp, path)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise
        atomic.fsync_dir(path.parent)


def agree(group, failure: OSError | None, what: str) -> None:
    """A collective: every process says whether its part of ``what`` succeeded; any failure
    is raised in every process as an OSError naming the failed processes and, where it
    failed, raised from its own error (a full disk stays one: ``atomic.is_io_failure``)."""
    if group is None or group.size == 1:
        if failure is not None:
            raise failure
        return
    failed = [rank for rank, bad in enumerate(group.gather_ints(failure is not None)) if bad]
    if failed:
        own = f": {failure}" if failure else ""
        raise OSError(f"{what} failed in process(es) {failed}{own}") from failure


def write(
    directory: Path,
    files: dict[str, dict[str, Tensor]],
    dtype: str,
    metadata: dict[str, str],
    group,
) -> None:
    """Write each file of ``files`` (file name -> tensor name -> :class:`Tensor`) into
    ``directory``, which process 0 created, the tensors stored as ``dtype``: a collective of
    ``group``'s processes (see the module's text); returns once every process's part is
    durable."""
    layouts = {
        file: header({n: t.shape for n, t in tensors.items()}, dtype, metadata)
        for file, tensors in files.items()
    }
    write_laid_out(directory, files, layouts, dtype, group)


def npy_layout(shape: Sequence[int], dtype: str):
    """The layout of one array in a ``.npy`` file as ``numpy.save`` writes it (format 1.0,
    C order): ``(header bytes, {"": data offset}, file size)``, the array named ``""``."""
    import io

    from numpy.lib import format as npy_format

    stored = np.dtype(stored_type(dtype))
    out = io.BytesIO()
    described = npy_format.dtype_to_descr(stored)
    info = {"descr": described, "fortran_order": False, "shape": tuple(int(n) for n in shape)}
    npy_format.write_array_header_1_0(out, info)
    head = out.getvalue()
    return head, {"": len(head)}, len(head) + math.prod(shape) * stored.itemsize


def write_laid_out(directory: Path, files: dict, layouts: dict, dtype: str, group) -> None:
    """:func:`write` into files of any layout: ``layouts`` gives each file's ``(header bytes,
    {tensor name: data offset}, file size)`` (:func:`header`, :func:`npy_layout`)."""
    rank, processes = (0, 1) if group is None else (group.rank, group.size)
    failure = None
    if rank == 0:
        try:
            for file, (head, _, size) in layouts.items():
                with open(directory / file, "wb") as out:
                    out.write(head)
                    out.truncate(size)
            atomic.fsync_dir(directory)  # the files' names durable (each is fsynced below)
        except OSError as exc:
            failure = exc
    agree(group, failure, f"laying out the safetensors files of {directory}")
    try:
        _write_slices(directory, files, layouts, stored_type(dtype), rank, processes)
    except OSError as exc:
        failure = exc
    agree(group, failure, f"writing the safetensors files of {directory}")


def _write_slices(directory, files, layouts, stored, rank: int, processes: int) -> None:
    """This process's slices of every file, each file fsynced (OSError naming the file)."""
    dealer = regions.Dealer()  # the same choices on every process: which holder writes a slice
    for file, tensors in files.items():
        _, offsets, _ = layouts[file]
        path = directory / file
        try:
            fd = os.open(path, os.O_WRONLY)
            try:
                for name, tensor in tensors.items():
                    for source in tensor.sources:
                        held = regions.distinct(source.leaf, processes)
                        for region, holders in sorted(held.items()):
                            if dealer.holder(holders) != rank:
                                continue
                            value = np.asarray(regions.value_of(source.leaf, region), np.float32)
                            placed = _placed(source, region, value)
                            if placed is not None:
                                starts, block = placed
                                block = block.astype(stored, order="C")
                                write_block(fd, offsets[name], tensor.shape, starts, block)
                os.fsync(fd)
            finally:
                os.close(fd)
        except OSError as exc:
            raise OSError(exc.errno, f"{path}: {exc.strerror or exc}") from exc
