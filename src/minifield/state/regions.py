"""Regions of a state array: the blocks its devices hold, which process takes each, and a
region read back from the blocks a checkpoint stored.

A region is a block of an array given as ``((start, stop), …)`` per axis. A sharded array's
devices hold regions that tile it (a replicated array: one region, the whole array, held by
every device). This module is the one place that deals blocks to their holders
(:class:`Dealer`): a checkpoint written by several processes stores every distinct region
once, written by one process holding it (:func:`owned`); an export writes each slice once
(``hf.parallel_files``); the state hash hashes each block of whole pieces once
(``state.pieces``, its blocks from :func:`merged`). A restore reads, for each region its own
devices need, the overlapping stored blocks (:func:`read`), whatever topology wrote them.
"""

from __future__ import annotations

import bisect
import hashlib
import itertools
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


def spread(leaf: Any) -> bool:
    """Laid out over several devices: a JAX array, or an abstract one (``ShapeDtypeStruct``
    with a sharding, a template that holds no values)."""
    sharding = getattr(leaf, "sharding", None)
    return sharding is not None and len(sharding.device_set) > 1


def needed(leaf: Any) -> list[Region] | None:
    """The distinct regions this process's devices hold of a template leaf sharded over
    several devices; None for a leaf read whole (a host value, on one device, replicated)."""
    if not spread(leaf):
        return None
    shape = tuple(leaf.shape)
    indices = leaf.sharding.addressable_devices_indices_map(shape).values()
    held = sorted({of_index(index, shape) for index in indices})
    return None if held == [whole(shape)] else held


def distinct(leaf: Any, processes: int | None = None) -> dict[Region, set[int]]:
    """``{region: processes holding it}`` of every distinct block of an array's layout (a
    host value, which each of ``processes`` (default: every JAX process) holds whole: one
    block held by all)."""
    import jax

    if not spread(leaf):
        if isinstance(leaf, jax.Array):
            return {whole(leaf.shape): {next(iter(leaf.sharding.device_set)).process_index}}
        count = jax.process_count() if processes is None else processes
        return {whole(np.shape(leaf)): set(range(count))}
    shape = tuple(leaf.shape)
    holders: dict[Region, set[int]] = {}
    for device, index in leaf.sharding.devices_indices_map(shape).items():
        holders.setdefault(of_index(index, shape), set()).add(device.process_index)
    return holders


def merged(
    held: dict[Region, set[int]], shape: Sequence[int], cell: Sequence[int]
) -> dict[Region, set[int]]:
    """``held`` (:func:`distinct`) as blocks that are unions of whole cells (``cell``: a
    cell's size along each axis, dividing ``shape``): along each axis a block ends only where
    a cell and a region both end, so a region that cuts a cell is merged with its neighbours
    until the cells are whole. Each block maps to the processes holding all of it (empty when
    no process does: its cells lie across processes)."""
    full = whole(shape)
    if volume(full) == 0:
        return {full: set().union(*held.values())}
    bounds = []
    for axis, (n, size) in enumerate(zip(shape, cell, strict=True)):
        ends = {end for region in held for end in region[axis]} | {0, int(n)}
        bounds.append(sorted(end for end in ends if end % size == 0))
    blocks: dict[tuple, set[int]] = {}
    for region, processes in held.items():
        # the blocks this region overlaps, along each axis
        spans = [
            range(bisect.bisect_right(b, start) - 1, bisect.bisect_left(b, stop))
            for b, (start, stop) in zip(bounds, region, strict=True)
        ]
        for at in itertools.product(*spans):
            blocks[at] = blocks[at] & processes if at in blocks else set(processes)
    return {
        tuple((b[i], b[i + 1]) for b, i in zip(bounds, at, strict=True)): processes
        for at, processes in blocks.items()
    }


class Dealer:
    """The one rule that gives a block held by several processes to one of them: blocks
    are counted in the order every process lists them (array by array, each array's blocks
    sorted) and the k-th goes to the (k mod holders)-th of its holders, so replicated blocks
    are dealt out over the processes and every process makes the same choices."""

    def __init__(self) -> None:
        self.turn = 0

    def holder(self, processes: Iterable[int]) -> int:
        holders = sorted(processes)
        chosen = holders[self.turn % len(holders)]
        self.turn += 1
        return chosen


def owned(leaves: Sequence[tuple[str, Any]], rank: int) -> list[tuple[str, Region, Any]]:
    """``(name, region, data)`` of the blocks of ``leaves`` that process ``rank`` writes:
    every distinct block once, by the process :class:`Dealer` gives it to."""
    dealer, mine = Dealer(), []
    for name, leaf in leaves:
        for region, processes in sorted(distinct(leaf).items()):
            if dealer.holder(processes) == rank:
                mine.append((name, region, value_of(leaf, region)))
    return mine


def _identity(value):
    return value


def regrouped(leaf: Any, cell: Sequence[int]) -> Any | None:
    """``leaf``, split along one axis of a 1-D mesh, laid out again over the same devices
    so that every block of whole cells (``cell``: a cell's size along each axis) is held
    whole by a process; None for another layout. A collective (every process calls it for
    the same arrays in the same order).

    Along the split axis the blocks are ``m = gcd(devices, cells along it)`` runs of whole
    cells, each over ``devices / m`` consecutive devices, split there over ``c`` devices and
    repeated ``devices / (m c)`` times: the largest ``c`` for which each run lies whole in a
    process, so a device holds ``devices / (m c)`` times its shard, the array only when no
    process holds two devices of a run."""
    import jax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    sharding = getattr(leaf, "sharding", None)
    if not isinstance(sharding, NamedSharding) or len(sharding.mesh.axis_names) != 1:
        return None
    name = sharding.mesh.axis_names[0]
    spec = list(sharding.spec) + [None] * (len(leaf.shape) - len(sharding.spec))
    if spec.count(name) != 1:
        return None
    axis = spec.index(name)
    devices = np.asarray(sharding.mesh.devices).reshape(-1)
    runs = math.gcd(len(devices), int(leaf.shape[axis]) // int(cell[axis]))
    span = len(devices) // runs
    for split in (c for c in range(span, 0, -1) if span % c == 0):
        mesh = Mesh(devices.reshape(runs, span // split, split), ("run", "copy", "part"))
        parts: list = [None] * len(leaf.shape)
        parts[axis] = ("run", "part")
        target = NamedSharding(mesh, PartitionSpec(*parts))
        laid = jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=target)
        if all(merged(distinct(laid), leaf.shape, cell).values()):
            return jax.jit(_identity, out_shardings=target)(leaf)
    return None


def value_of(leaf: Any, block: Region) -> Any:
    """``block`` of ``leaf`` from this process's copies: a shard's own data (a device array)
    where one device holds exactly that block, else a host array put together from the
    shards that overlap it (the caller's process holds all of it)."""
    if not spread(leaf):
        return leaf
    shape = tuple(leaf.shape)
    local: dict[Region, Any] = {}
    for shard in leaf.addressable_shards:
        local.setdefault(of_index(shard.index, shape), shard.data)
    if block in local:
        return local[block]
    out = np.empty(shape_of(block), leaf.dtype)
    for region, data in local.items():
        common = overlap(region, block)
        if common is not None and volume(common):
            out[inner(common, block)] = np.asarray(data)[inner(common, region)]
    return out


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
    """One stored block of an array: its region, the file holding it, where, and its sha256
    (None where the format checks the array by its digest instead: the caller checks it)."""

    __slots__ = ("region", "file", "offset", "nbytes", "sha256")

    def __init__(self, region: Region, file: str, offset: int, nbytes: int, sha256: str | None):
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
            data = destination.reshape(-1).view(np.uint8)
            if block.sha256 is not None and hashlib.sha256(data).hexdigest() != block.sha256:
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
