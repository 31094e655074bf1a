"""Safetensors tensors into arrays: FP32 in this project's layout, or as stored.

Two readings. :func:`read_fp32` (FP32 master parameters, what full fine-tuning trains):

The file is memory-mapped (:class:`Source`); each tensor is widened to FP32 straight from the
page cache block by block — a block of rows checked for finite values on its stored bits while
it is in cache, converted contiguously (an F32 block is not copied first), then transposed into
place where a ``torch.nn.Linear`` weight's ``[out, in]`` becomes the ``[in, out]`` that
:mod:`minifield.models.llama` holds — and its mapped pages are dropped once it is converted; an
F32 tensor that needs no transpose is read as stored (below). :func:`read_stored` (a frozen base, inference): the tensor in its
own dtype and HF's ``[out, in]`` layout, read straight into a 64-byte-aligned buffer that JAX
adopts without a copy — one pass over the bytes, like reading the file, plus a finite check of
each block while it is in cache. Reading a checkpoint's names, shapes and config is
:mod:`.checkpoint`'s.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import numpy as np

from .config import CheckpointError

ACCEPTED_DTYPES = {"F32": np.float32, "BF16": None, "F16": np.float16}

#: rows of a source matrix widened and transposed at a time: each row of the result then
#: receives one whole 64-byte cache line (16 FP32) per block, and the widened block stays in
#: the CPU caches while it is scattered (the timings: docs/performance.md, "Loading a base
#: model")
_TRANSPOSE_ROWS = 16
#: elements widened at a time where no transpose is needed (the block stays in cache for the
#: finite check)
_CHUNK = 1 << 20


def data_offsets(path: Path) -> dict[str, tuple[int, int, str]]:
    """Tensor name -> (absolute start, end, dtype) in a safetensors file whose header the
    library has already checked (``safe_open`` in :func:`load`): an 8-byte little-endian
    header length, the JSON header, then the data, offsets relative to its start."""
    with open(path, "rb") as f:
        length = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(length))
    base = 8 + length
    return {
        name: (base + entry["data_offsets"][0], base + entry["data_offsets"][1], entry["dtype"])
        for name, entry in header.items()
        if name != "__metadata__"
    }


def source_dtype_of(kind: str) -> np.dtype:
    """The numpy dtype of a safetensors dtype name (BF16: ``ml_dtypes.bfloat16``)."""
    if kind == "BF16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(ACCEPTED_DTYPES[kind])


def _aligned(shape: tuple[int, ...], dtype=np.float32) -> np.ndarray:
    """An uninitialised array at a 64-byte boundary (what lets JAX's CPU backend take it over
    without a copy)."""
    dtype = np.dtype(dtype)
    size = dtype.itemsize * math.prod(shape)
    raw = np.empty(size + 64, np.uint8)
    offset = (-raw.ctypes.data) % 64
    return raw[offset : offset + size].view(dtype).reshape(shape)


class Source:
    """A safetensors file memory-mapped read-only: a tensor is widened straight from the page
    cache (no copy into a read buffer first), and its mapped pages are dropped from this
    process once it is converted (``MADV_DONTNEED``; the page cache keeps them), so the file
    adds at most about one tensor to the resident memory."""

    def __init__(self, path: Path):
        self.path = path

    def __enter__(self) -> Source:
        import mmap

        self._file = open(self.path, "rb")  # noqa: SIM115 - closed in __exit__
        self.size = os.fstat(self._file.fileno()).st_size
        self._map = mmap.mmap(self._file.fileno(), 0, access=mmap.ACCESS_READ)
        return self

    def __exit__(self, *exc) -> None:
        self._map.close()
        self._file.close()

    def array(self, start: int, end: int, dtype: np.dtype, shape) -> np.ndarray:
        """The bytes ``[start, end)`` as an array viewing the mapping (no copy)."""
        if end > self.size:
            raise CheckpointError(f"{self.path}: ends inside a tensor's data")
        return np.frombuffer(self._map, dtype, (end - start) // dtype.itemsize, start).reshape(
            shape
        )

    def read_into(self, out: np.ndarray, start: int) -> None:
        """The file's bytes from ``start`` into ``out`` (one ``pread``: no page faults on the
        mapping, no intermediate buffer)."""
        view = memoryview(out.reshape(-1).view(np.uint8))
        done = 0
        while done < len(view):
            count = os.preadv(self._file.fileno(), [view[done:]], start + done)
            if count == 0:
                raise CheckpointError(f"{self.path}: ends inside a tensor's data")
            done += count

    def release(self, start: int, end: int) -> None:
        drop_pages(self._map, start, end)


def drop_pages(mapping, start: int, end: int) -> None:
    """Drop the pages holding bytes ``[start, end)`` of a read-only file ``mapping`` from this
    process (``MADV_DONTNEED``: the page cache keeps them, and a later read maps them again)."""
    import mmap

    first = start - start % mmap.PAGESIZE
    mapping.madvise(mmap.MADV_DONTNEED, first, end - first)


def _non_finite(path: Path, name: str, value: np.ndarray) -> CheckpointError:
    bad = np.flatnonzero(~np.isfinite(value)).size
    return CheckpointError(
        f"{path}: tensor {name} holds {bad} non-finite values (NaN or infinity); a model "
        "cannot train from it"
    )


def _all_finite(block: np.ndarray, bits_type, mask: int, scratch: np.ndarray) -> bool:
    """No infinity or NaN in ``block`` (stored dtype): no element's exponent bits all ones —
    an integer pass over the block while it is in cache, no boolean array."""
    flat = block.reshape(-1).view(bits_type)
    return int(np.bitwise_and(flat, mask, out=scratch[: flat.size]).max(initial=0)) != mask


def _widen(data: np.ndarray, transpose: bool) -> tuple[np.ndarray, bool]:
    """``(FP32 copy of data in this project's layout, all finite)``, block by block: each block
    is checked for finite values on its stored bits, widened contiguously where it is not FP32
    already (ml_dtypes' cast loop is slow on a strided view; an FP32 block is not copied
    first), then put into place."""
    bits_type, mask = _EXPONENT[_KIND_OF[data.dtype.name]]
    finite = True
    if not transpose:
        out = _aligned(data.shape)
        flat, source = out.reshape(-1), data.reshape(-1)
        scratch = np.empty(min(_CHUNK, flat.size), bits_type)
        for first in range(0, flat.size, _CHUNK):
            block = source[first : first + _CHUNK]
            finite = finite and _all_finite(block, bits_type, mask, scratch)
            np.copyto(flat[first : first + _CHUNK], block, casting="unsafe")
        return out, finite
    rows, cols = data.shape  # stored [out, in]; held [in, out]
    out = _aligned((cols, rows))
    scratch = np.empty(min(_TRANSPOSE_ROWS, rows) * cols, bits_type)
    for first in range(0, rows, _TRANSPOSE_ROWS):
        block = data[first : first + _TRANSPOSE_ROWS]
        finite = finite and _all_finite(block, bits_type, mask, scratch)
        if block.dtype != np.float32:
            block = block.astype(np.float32)
        out[:, first : first + block.shape[0]] = block.T
    return out, finite


def to_fp32(data: np.ndarray, transpose: bool) -> np.ndarray:
    """An FP32 array of a stored ``[out, in]`` (``transpose``) or as-laid-out tensor held in
    memory (a prepared base's memory-mapped arrays): :func:`read_fp32`'s widening, block by
    block; an FP32 array that needs no transpose is returned as it is (no copy)."""
    if data.dtype == np.float32 and not transpose:
        return data
    if data.ndim == 3:  # stacked experts [E, out, in]: each expert's matrix in turn
        out = _aligned((data.shape[0], *(data.shape[:0:-1] if transpose else data.shape[1:])))
        for j, matrix in enumerate(data):
            out[j] = _widen(matrix, transpose)[0]
        return out
    return _widen(data, transpose)[0]


def reading_pool(tasks: int):
    """Threads for converting tensors side by side (numpy's copies, casts and ``pread``
    release the GIL): one per CPU this process may run on, at most 8 and at most ``tasks``.
    The values do not depend on it: each tensor is converted whole by one thread."""
    from concurrent.futures import ThreadPoolExecutor

    return ThreadPoolExecutor(max(1, min(len(os.sched_getaffinity(0)), 8, tasks)))


def read_fp32(
    source: Source, start: int, end: int, shape, dtype: np.dtype, transpose: bool, name: str
) -> np.ndarray:
    """One tensor as an FP32 array in this project's layout, widened straight from the
    mapped file (an FP32 tensor not transposed is read as stored: :func:`read_stored`, one
    ``pread``); raises :class:`CheckpointError` naming the file and tensor for a size that
    disagrees with the shape or a non-finite value."""
    if end - start != math.prod(shape) * dtype.itemsize:
        raise CheckpointError(f"{source.path}: tensor {name}'s data size disagrees with its shape")
    if dtype == np.float32 and not transpose:
        return read_stored(source, start, end, shape, "F32", name)
    data = source.array(start, end, dtype, shape)
    try:
        value, finite = _widen(data, transpose)
    finally:
        del data
        source.release(start, end)
    if not finite:
        raise _non_finite(source.path, name, value)
    return value


#: the exponent bits of each stored float type (all ones: infinity or NaN), by item size and
#: the unsigned view that holds them
_EXPONENT = {
    "BF16": (np.uint16, 0x7F80),
    "F16": (np.uint16, 0x7C00),
    "F32": (np.uint32, 0x7F800000),
}
#: numpy dtype name -> safetensors dtype name
_KIND_OF = {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}


def read_stored(source: Source, start: int, end: int, shape, kind: str, name: str) -> np.ndarray:
    """One tensor as stored (its own dtype ``kind``, HF's layout), in a 64-byte-aligned buffer;
    raises :class:`CheckpointError` naming the file and tensor for a size that disagrees with
    the shape or a non-finite value. No conversion: the finite check looks at the exponent bits
    (all ones is infinity or NaN), block by block right after each block is read."""
    dtype = source_dtype_of(kind)
    if end - start != math.prod(shape) * dtype.itemsize:
        raise CheckpointError(f"{source.path}: tensor {name}'s data size disagrees with its shape")
    out = _aligned(tuple(shape), dtype)
    bits_type, mask = _EXPONENT[kind]
    flat = out.reshape(-1)
    bits = flat.view(bits_type)
    scratch = np.empty(min(_CHUNK, flat.size), bits_type)
    finite = True
    for first in range(0, flat.size, _CHUNK):
        part = flat[first : first + _CHUNK]
        source.read_into(part, start + first * dtype.itemsize)
        masked = np.bitwise_and(bits[first : first + _CHUNK], mask, out=scratch[: part.size])
        finite = finite and int(masked.max()) != mask
    if not finite:
        raise _non_finite(source.path, name, out.astype(np.float32))
    return out
