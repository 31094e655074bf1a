"""Safetensors tensors into FP32 arrays in this project's layout, at the speed of the memory.

The file is memory-mapped (:class:`Source`); each tensor is widened to FP32 straight from the
page cache block by block — a block of rows converted contiguously, checked for finite values
while it is in cache, then transposed into place where a ``torch.nn.Linear`` weight's
``[out, in]`` becomes the ``[in, out]`` that :mod:`.llama` holds — and its mapped pages are
dropped once it is converted. Reading a checkpoint's names, shapes and config is
:mod:`.hf_checkpoint`'s.
"""

from __future__ import annotations

import json
import math
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from .hf_config import CheckpointError

ACCEPTED_DTYPES = {"F32": np.float32, "BF16": None, "F16": np.float16}

#: rows of a source matrix widened and transposed at a time: each row of the result then
#: receives one whole 64-byte cache line (16 FP32) per block, and the widened block stays in
#: the CPU caches while it is scattered (16 rows measured 2.3x faster than 64)
_TRANSPOSE_ROWS = 16
#: elements widened at a time where no transpose is needed (the block stays in cache for the
#: finite check)
_CHUNK = 1 << 20
#: threads widening one tensor (every core: numpy's loops release the GIL)
_THREADS = max(1, os.cpu_count() or 1)
_POOL: ThreadPoolExecutor | None = None


def _pool() -> ThreadPoolExecutor:
    """The widening threads, started on first use and kept (a load converts tensor after
    tensor; starting threads per tensor would cost more than small tensors do)."""
    global _POOL
    if _POOL is None:
        _POOL = ThreadPoolExecutor(max_workers=_THREADS, thread_name_prefix="hf-widen")
    return _POOL


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


def source_dtype(name: str, offsets: dict) -> np.dtype:
    kind = offsets[name][2]
    if kind == "BF16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(ACCEPTED_DTYPES[kind])


def _aligned_fp32(shape: tuple[int, ...]) -> np.ndarray:
    """An uninitialised FP32 array at a 64-byte boundary (what lets JAX's CPU backend take
    it over without a copy)."""
    count = math.prod(shape)
    raw = np.empty(4 * count + 64, np.uint8)
    offset = (-raw.ctypes.data) % 64
    return raw[offset : offset + 4 * count].view(np.float32).reshape(shape)


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

    def release(self, start: int, end: int) -> None:
        import mmap

        first = start - start % mmap.PAGESIZE
        self._map.madvise(mmap.MADV_DONTNEED, first, end - first)


def _non_finite(path: Path, name: str, value: np.ndarray) -> CheckpointError:
    bad = np.flatnonzero(~np.isfinite(value)).size
    return CheckpointError(
        f"{path}: tensor {name} holds {bad} non-finite values (NaN or infinity); a model "
        "cannot train from it"
    )


def _widen_block(source: np.ndarray, out: np.ndarray) -> bool:
    """Widen ``source`` into ``out`` (FP32, same shape); whether every value is finite.

    BF16 is the top half of an FP32 of the same value, so its widening is an integer shift of
    its bits into the upper 16 bits (exact for every value: NaN payloads, infinities,
    subnormals, -0 included) — a plain numpy loop that releases the GIL, several times
    faster than ml_dtypes' cast loop."""
    if source.dtype.name == "bfloat16":
        np.left_shift(source.view(np.uint16), 16, out=out.view(np.uint32), dtype=np.uint32)
    else:
        np.copyto(out, source, casting="unsafe")
    return bool(np.isfinite(out).all())


def _widen_rows(data: np.ndarray, out: np.ndarray, first: int, last: int) -> bool:
    """Rows ``[first, last)`` of a stored ``[out, in]`` matrix widened into ``out`` (held
    ``[in, out]``), :data:`_TRANSPOSE_ROWS` at a time; whether every value was finite."""
    finite = True
    for row in range(first, last, _TRANSPOSE_ROWS):
        stop = min(row + _TRANSPOSE_ROWS, last)
        block = np.empty((stop - row, data.shape[1]), np.float32)
        finite = _widen_block(data[row:stop], block) and finite
        out[:, row:stop] = block.T
    return finite


def _widen(data: np.ndarray, transpose: bool) -> tuple[np.ndarray, bool]:
    """``(FP32 copy of data in this project's layout, all finite)``, block by block on every
    core (numpy's loops release the GIL): each block is widened contiguously, checked for
    finite values while in cache, then scattered into place; the blocks of one tensor are
    split among the threads in contiguous ranges (disjoint parts of the result)."""
    if not transpose:
        out = _aligned_fp32(data.shape)
        flat, source = out.reshape(-1), data.reshape(-1)
        starts = range(0, flat.size, _CHUNK)
        work = [(source[i : i + _CHUNK], flat[i : i + _CHUNK]) for i in starts]
        # every block converted before the verdict (a refusal counts the non-finite values)
        return out, all(list(_pool().map(lambda pair: _widen_block(*pair), work)))
    rows, cols = data.shape  # stored [out, in]; held [in, out]
    out = _aligned_fp32((cols, rows))
    step = -(-rows // _THREADS // _TRANSPOSE_ROWS) * _TRANSPOSE_ROWS  # whole blocks per thread
    ranges = [(first, min(first + step, rows)) for first in range(0, rows, step)]
    return out, all(list(_pool().map(lambda r: _widen_rows(data, out, *r), ranges)))


def read_fp32(
    source: Source, start: int, end: int, shape, dtype: np.dtype, transpose: bool, name: str
) -> np.ndarray:
    """One tensor as an FP32 array in this project's layout, widened straight from the
    mapped file; raises :class:`CheckpointError` naming the file and tensor for a size that
    disagrees with the shape or a non-finite value."""
    if end - start != math.prod(shape) * dtype.itemsize:
        raise CheckpointError(f"{source.path}: tensor {name}'s data size disagrees with its shape")
    data = source.array(start, end, dtype, shape)
    try:
        value, finite = _widen(data, transpose)
    finally:
        del data
        source.release(start, end)
    if not finite:
        raise _non_finite(source.path, name, value)
    return value
