"""Regions of a state array: the blocks its devices hold, which process writes each, and a
region read back from the blocks a checkpoint stored.

A region is a block of an array given as ``((start, stop), …)`` per axis. A sharded array's
devices hold regions that tile it (a replicated array: one region, the whole array, held by
every device). A checkpoint written by several processes stores every distinct region once,
written by one process holding it (:func:`owned`); a restore reads, for each region its own
devices need, the overlapping stored blocks (:func:`read`), whatever topology wrote them.
"""

from __future__ import annotations

import hashlib
import math
import mmap
import os
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np

Region = tuple[tuple[int, int], ...]


class RegionError(Exception):
    """Stored blocks that cannot give a region (unreadable, corrupt, not tiling the array)."""


def whole(shape: Sequence[int]) -> Region:
    return tuple((0, int(n)) for n in shape)


def of_index(index: tuple, shape: Sequence[int]) -> Region:
    """The region a device's index (a tuple of slices, as JAX's shardings give) covers."""
    region = []
    for axis, part in enumerate(index):
        start, stop, step = part.indices(int(shape[axis]))
        if step != 1:
            raise ValueError(f"a strided shard ({part}) is not a region")
        region.append((start, stop))
    return tuple(region)


def shape_of(region: Region) -> tuple[int, ...]:
    return tuple(b - a for a, b in region)


def volume(region: Region) -> int:
    return math.prod(shape_of(region))


def overlap(first: Region, second: Region) -> Region | None:
    both = tuple((max(a, c), min(b, d)) for (a, b), (c, d) in zip(first, second, strict=True))
    return both if all(a < b for a, b in both) or not both else None


def inner(region: Region, within: Region) -> tuple[slice, ...]:
    """``region`` as slices of the block ``within`` (which contains it)."""
    return tuple(slice(a - c, b - c) for (a, b), (c, _) in zip(region, within, strict=True))


def _spread(leaf: Any) -> bool:
    """Laid out over several devices: a JAX array, or an abstract one (``ShapeDtypeStruct``
    with a sharding, a template that holds no values)."""
    sharding = getattr(leaf, "sharding", None)
    return sharding is not None and len(sharding.device_set) > 1


def needed(leaf: Any) -> list[Region] | None:
    """The distinct regions this process's devices hold of a template leaf sharded over
    several devices; None for a leaf read whole (a host value, on one device, replicated)."""
    if not _spread(leaf):
        return None
    shape = tuple(leaf.shape)
    indices = leaf.sharding.addressable_devices_indices_map(shape).values()
    held = sorted({of_index(index, shape) for index in indices})
    return None if held == [whole(shape)] else held


def distinct(leaf: Any) -> dict[Region, set[int]]:
    """``{region: processes holding it}`` of every distinct block of an array's layout (a
    value every process holds whole: one block held by all)."""
    import jax

    if not _spread(leaf):
        if isinstance(leaf, jax.Array):
            return {whole(leaf.shape): {next(iter(leaf.sharding.device_set)).process_index}}
        return {whole(np.shape(leaf)): set(range(jax.process_count()))}
    shape = tuple(leaf.shape)
    holders: dict[Region, set[int]] = {}
    for device, index in leaf.sharding.devices_indices_map(shape).items():
        holders.setdefault(of_index(index, shape), set()).add(device.process_index)
    return holders


def owned(leaves: Sequence[tuple[str, Any]], rank: int) -> list[tuple[str, Region, Any]]:
    """``(name, region, data)`` of the blocks of ``leaves`` that process ``rank`` writes:
    every distinct block once, by one of the processes holding it. A block held by several
    (a replicated array) is dealt to them in turn, counting every block of every array in
    order, so the same blocks go to the same process on every process."""
    mine, turn = [], 0
    for name, leaf in leaves:
        for region, processes in sorted(distinct(leaf).items()):
            holders = sorted(processes)
            if holders[turn % len(holders)] == rank:
                mine.append((name, region, _data_of(leaf, region)))
            turn += 1
    return mine


def _data_of(leaf: Any, region: Region) -> Any:
    if not _spread(leaf):
        return leaf
    shape = tuple(leaf.shape)
    return next(s.data for s in leaf.addressable_shards if of_index(s.index, shape) == region)


def check_tiling(name: str, shape: Sequence[int], regions: Iterable[Region]) -> None:
    """Refuse stored blocks of an array that do not tile it exactly once."""
    regions = list(regions)
    full = whole(shape)
    for region in regions:
        inside = len(region) == len(full) and all(
            0 <= a <= b <= n for (a, b), (_, n) in zip(region, full, strict=True)
        )
        if not inside:
            raise RegionError(
                f"state array {name!r}: block {list(region)} is outside {list(shape)}"
            )
    for i, first in enumerate(regions):
        for second in regions[i + 1 :]:
            if overlap(first, second) is not None and volume(first) and volume(second):
                raise RegionError(
                    f"state array {name!r}: blocks {list(first)} and {list(second)} overlap"
                )
    if sum(volume(r) for r in regions) != volume(full) or (not regions and volume(full)):
        raise RegionError(f"state array {name!r}: the stored blocks do not cover {list(shape)}")


class Stored:
    """One stored block of an array: its region, the file holding it, where, and its sha256."""

    __slots__ = ("region", "file", "offset", "nbytes", "sha256")

    def __init__(self, region: Region, file: str, offset: int, nbytes: int, sha256: str):
        self.region, self.file, self.offset = region, file, offset
        self.nbytes, self.sha256 = nbytes, sha256


def _pread_into(fd: int, target: np.ndarray, offset: int, where: str) -> None:
    view = memoryview(target.reshape(-1).view(np.uint8))
    done = 0
    while done < len(view):
        got = os.preadv(fd, [view[done:]], offset + done)
        if got <= 0:
            raise RegionError(f"{where}: ends before byte {offset + len(view)} (truncated)")
        done += got


def read(
    name: str,
    region: Region,
    dtype: np.dtype,
    stored: Sequence[Stored],
    opened: Callable[[str], int],
) -> tuple[np.ndarray, bool]:
    """``region`` of state array ``name`` from its ``stored`` blocks (``opened(file)`` gives a
    file descriptor). Returns the values and whether every byte was verified: a stored block
    inside the region is read whole and its sha256 checked (naming the file on a mismatch);
    a block the region cuts is read only where they overlap (no sha256 can cover that part:
    the caller verifies the state hash once the state is placed)."""
    target = np.empty(shape_of(region), dtype)
    verified = True
    for block in stored:
        common = overlap(block.region, region)
        if common is None or target.size == 0:
            continue
        fd = opened(block.file)
        where = f"{block.file} (state array {name!r}, bytes {block.offset}-{block.offset + block.nbytes})"
        if common == block.region:
            if common == region:
                destination = target
            else:
                destination = np.empty(shape_of(block.region), dtype)
            _pread_into(fd, destination, block.offset, where)
            if hashlib.sha256(destination.reshape(-1).view(np.uint8)).hexdigest() != block.sha256:
                raise RegionError(f"{where}: sha256 mismatch")
            if destination is not target:
                target[inner(common, region)] = destination
            continue
        verified = False
        with mmap.mmap(fd, 0, access=mmap.ACCESS_READ) as mapped:
            if mapped.size() < block.offset + block.nbytes:
                raise RegionError(f"{where}: the file ends before the block (truncated)")
            count = block.nbytes // dtype.itemsize
            data = np.frombuffer(mapped, dtype, count, block.offset).reshape(shape_of(block.region))
            target[inner(common, region)] = data[inner(common, block.region)]
            del data  # no view of the mapping may outlive it
    return target, verified


class HostSlices:
    """The regions of one state array that this process's devices need, read from a
    checkpoint: what ``make_array_from_callback`` puts on each device (never the whole
    array)."""

    def __init__(self, shape: Sequence[int], dtype: np.dtype, blocks: dict[Region, np.ndarray]):
        self.shape, self.dtype, self.blocks = tuple(shape), np.dtype(dtype), blocks

    def __getitem__(self, index: tuple) -> np.ndarray:
        index = index if isinstance(index, tuple) else (index,)
        index = index + (slice(None),) * (len(self.shape) - len(index))
        region = of_index(index, self.shape)
        if region not in self.blocks:
            raise ValueError(
                f"region {list(region)} was not read from the checkpoint (read: "
                f"{[list(r) for r in self.blocks]}): the state is placed on other devices "
                "than its template's"
            )
        return self.blocks[region]
