"""Checkpoints written by several processes at once: format ``minifield-checkpoint/4``.

A state spread over several processes' devices is never gathered to be saved. Each process
writes the blocks its devices hold into a part file of its own, in parallel; process 0
commits the checkpoint once every part is durable::

    checkpoints/step-00000004/
        arrays-00000-of-00002.bin   process 0's blocks, each at an aligned offset
        arrays-00001-of-00002.bin   process 1's
        manifest.json               written last by process 0: its presence means "committed"

The sequence (:func:`save`, a collective): process 0 opens the temporary directory (a step
not above the last committed one is refused); every process writes its part file,
hashing each block on the chunks written, fsyncs it, and writes the part's description
(``part-0000i.json``, fsynced); the processes exchange only whether their part is durable;
process 0 then reads the descriptions, writes and fsyncs the manifest, fsyncs the directory,
renames it into place and fsyncs the parent, as for a one-process checkpoint. A part that
failed, a process killed before the rename, anything short of the rename: the temporary
directory is never adopted, and the previous checkpoint resumes.

The manifest records the parts (``file``, ``size``) and, for each array, its name, dtype,
shape, version-3 digest (:mod:`.pieces`) and blocks (``part``, ``region`` as ``[start,
stop]`` per axis, ``offset``, ``nbytes``, ``sha256``). Every distinct block of a sharded
array is stored once; a replicated array once, by one of its processes (in turn, so the
writing is shared). Restoring (:func:`read`), a process reads only the blocks, or the parts
of blocks, its own devices need (:mod:`.regions`): a checkpoint written by N processes
restores on any M.
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from .. import atomic
from . import checkpoint_data, regions
from .checkpoint_data import ALIGNMENT, CheckpointError

FORMAT = "minifield-checkpoint/4"
_PART_FILE = re.compile(r"arrays-(\d{5})-of-(\d{5})\.bin")


def part_file(rank: int, count: int) -> str:
    return f"arrays-{rank:05d}-of-{count:05d}.bin"


def part_description(rank: int) -> str:
    return f"part-{rank:05d}.json"


def _host(data: Any) -> np.ndarray:
    if isinstance(data, np.ndarray):
        return data
    import jax

    return np.asarray(jax.device_get(data))


def blocks_of(leaves: Sequence[tuple[str, Any]], rank: int) -> list[tuple[str, tuple, Any]]:
    """``(name, region, host array)`` of the blocks process ``rank`` writes of ``leaves``
    (``(name, array)`` in name order): on the CPU backend views of the device buffers (no
    copy), on an accelerator a copy of this process's blocks only."""
    return [(name, region, _host(data)) for name, region, data in regions.owned(leaves, rank)]


def write_part(tmp: Path, rank: int, count: int, blocks: Sequence[tuple[str, tuple, Any]]) -> dict:
    """Write this process's ``blocks`` (:func:`blocks_of`) into its part file under ``tmp``
    and fsync it. Returns its description (for :func:`announce`)."""
    file = part_file(rank, count)
    entries = checkpoint_data.write(
        tmp / file,
        [(str(i), data) for i, (_n, _r, data) in enumerate(blocks)],
        check=checkpoint_data.SHA256,
    )
    slices = [
        {
            "name": name,
            "region": [list(axis) for axis in region],
            "offset": entry["offset"],
            "nbytes": entry["nbytes"],
            "sha256": entry["sha256"],
        }
        for (name, region, _data), entry in zip(blocks, entries, strict=True)
    ]
    size = checkpoint_data.description(entries)["size"]
    return {"part": rank, "file": file, "size": size, "blocks": slices}


def announce(tmp: Path, description: dict) -> None:
    """Say that a part is durable: its description, fsynced and renamed into place (what
    process 0 reads to build the manifest)."""
    atomic.write_json(tmp / part_description(description["part"]), description)


def manifest(
    leaves: Sequence[tuple[str, Any]],
    descriptions: Sequence[dict],
    digests: dict[str, str],
    head: dict,
) -> dict:
    """The manifest of a checkpoint whose parts are described by ``descriptions`` (in
    process order); ``head`` holds step, digest, hash and extra fields."""
    blocks: dict[str, list[dict]] = {name: [] for name, _leaf in leaves}
    for description in descriptions:
        for block in description["blocks"]:
            entry = {k: v for k, v in block.items() if k != "name"}
            blocks[block["name"]].append({"part": description["part"], **entry})
    arrays = [
        {
            "name": name,
            "dtype": np.dtype(leaf.dtype).str,
            "shape": [int(n) for n in np.shape(leaf)],
            "digest": digests[name],
            "blocks": sorted(blocks[name], key=lambda b: b["region"]),
        }
        for name, leaf in leaves
    ]
    parts = [{"file": d["file"], "size": d["size"]} for d in descriptions]
    return {"format": FORMAT, **head, "alignment": ALIGNMENT, "parts": parts, "arrays": arrays}


def save(
    tmp: Path,
    leaves: Sequence[tuple[str, Any]],
    group,
    *,
    open_directory: Callable[[], None],
    commit: Callable[[list[dict]], None],
    fault: Callable[[str], None] | None = None,
) -> None:
    """The collective write of one checkpoint into ``tmp`` (see the module's docstring):
    ``open_directory`` runs on process 0 first, ``commit(descriptions)`` on process 0 once
    every part is durable. ``fault(phase)`` (fault injection only) runs at ``"opened"``
    (before any part), ``"part_written"`` (this process's part durable, not yet announced)
    and, on process 0, ``"before_commit"``. An error anywhere raises :class:`CheckpointError` in every
    process, naming the process that failed; the temporary directory is then removed."""
    rank, count = group.rank, group.size

    def agreed(error: str, what: str) -> None:
        errors = group.gather_texts(error)
        failed = [(r, text) for r, text in enumerate(errors) if text]
        if failed:
            if rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)
            said = "; ".join(f"process {r}: {text}" for r, text in failed)
            raise CheckpointError(f"{what} failed ({said})")

    error = ""
    if rank == 0:
        try:
            open_directory()
        except (OSError, CheckpointError) as exc:
            error = f"{type(exc).__name__}: {exc}"
    agreed(error, f"opening {tmp}")
    if fault is not None:
        fault("opened")
    description, error = None, ""
    try:
        description = write_part(tmp, rank, count, blocks_of(leaves, rank))
        if fault is not None:
            fault("part_written")
        announce(tmp, description)
    except (OSError, CheckpointError) as exc:
        error = f"{type(exc).__name__}: {exc}"
    agreed(error, f"writing the parts of {tmp}")
    error = ""
    if rank == 0:
        try:
            descriptions = [description] + [
                atomic.read_json(tmp / part_description(r)) for r in range(1, count)
            ]
            if fault is not None:
                fault("before_commit")
            commit(descriptions)
        except (OSError, ValueError, CheckpointError) as exc:
            shutil.rmtree(tmp, ignore_errors=True)
            error = f"{type(exc).__name__}: {exc}"
    agreed(error, f"committing {tmp}")


def failed_marker(rank: int) -> str:
    return f"part-{rank:05d}.failed"


def mark_failed(tmp: Path, rank: int, error: str) -> None:
    """Say in ``tmp`` that this process's part will not come (best effort: process 0 then
    gives up at once instead of at its time limit)."""
    try:
        atomic.write_bytes(tmp / failed_marker(rank), error.encode())
    except OSError:
        pass


def await_parts(tmp: Path, count: int, timeout: float, poll: float = 0.01) -> list[dict]:
    """Process 0's wait, off the collectives, for the descriptions of parts 1..count-1 (each
    written, fsynced and renamed into place only once its part is durable); raises
    :class:`CheckpointError` naming a process that failed, or all missing at ``timeout``."""
    import time

    deadline = time.monotonic() + timeout
    found: dict[int, dict] = {}
    while True:
        for rank in range(1, count):
            if rank in found:
                continue
            if (tmp / failed_marker(rank)).exists():
                said = (tmp / failed_marker(rank)).read_text(errors="replace")
                raise CheckpointError(f"process {rank}'s part failed: {said}")
            if (tmp / part_description(rank)).exists():
                found[rank] = atomic.read_json(tmp / part_description(rank))
        if len(found) == count - 1:
            return [found[rank] for rank in range(1, count)]
        if time.monotonic() > deadline:
            missing = [rank for rank in range(1, count) if rank not in found]
            raise CheckpointError(
                f"the parts of processes {missing} did not come in {timeout:.0f} s"
            )
        time.sleep(poll)


# -- reading ------------------------------------------------------------------------------------


def _checked_parts(manifest_path: Path, manifest: dict) -> list[dict]:
    if manifest.get("alignment") != ALIGNMENT:
        raise CheckpointError(f"{manifest_path}: field alignment must be {ALIGNMENT}")
    parts = manifest.get("parts")
    if not isinstance(parts, list) or not parts:
        raise CheckpointError(f"{manifest_path}: field parts must be a non-empty list")
    for rank, part in enumerate(parts):
        expected = part_file(rank, len(parts))
        if not isinstance(part, dict) or part.get("file") != expected:
            raise CheckpointError(f"{manifest_path}: parts[{rank}].file must be {expected!r}")
        if not isinstance(part.get("size"), int) or part["size"] < 0:
            raise CheckpointError(f"{manifest_path}: parts[{rank}].size must be a size in bytes")
    return parts


def layout(manifest_path: Path, manifest: dict) -> dict[str, tuple[np.dtype, tuple, list]]:
    """``{name: (dtype, shape, [regions.Stored])}`` after checking that the blocks tile each
    array and lie in their parts as the format says (aligned, not overlapping, inside the
    part's recorded size, sizes agreeing with the regions)."""
    parts = _checked_parts(manifest_path, manifest)
    out: dict[str, tuple[np.dtype, tuple, list]] = {}
    placed: list[list[tuple[int, int, str]]] = [[] for _ in parts]
    for index, entry in enumerate(manifest.get("arrays", [])):
        where = f"{manifest_path}: arrays[{index}]"
        try:
            name, dtype = entry["name"], np.dtype(entry["dtype"])
            shape = tuple(int(n) for n in entry["shape"])
            stored = []
            for block in entry["blocks"]:
                region = tuple((int(a), int(b)) for a, b in block["region"])
                part = parts[int(block["part"])]
                stored.append(
                    regions.Stored(
                        region, part["file"], int(block["offset"]), int(block["nbytes"]),
                        str(block["sha256"]),
                    )
                )  # fmt: skip
                placed[int(block["part"])].append(
                    (int(block["offset"]), int(block["nbytes"]), name)
                )
                if regions.volume(region) * dtype.itemsize != stored[-1].nbytes:
                    raise ValueError(f"block {list(region)}: nbytes is not the region's size")
            if not isinstance(entry["digest"], str) or dtype.hasobject:
                raise ValueError("digest must be a string, dtype a plain numeric dtype")
            regions.check_tiling(name, shape, (s.region for s in stored))
        except (KeyError, TypeError, ValueError, IndexError, regions.RegionError) as exc:
            raise CheckpointError(
                f"{where}: needs name, dtype, shape, digest and blocks (part, region, offset, "
                f"nbytes, sha256) tiling the array ({type(exc).__name__}: {exc})"
            ) from exc
        out[name] = (dtype, shape, stored)
    for rank, blocks in enumerate(placed):
        end = 0
        for offset, nbytes, name in sorted(blocks):
            if offset % ALIGNMENT or offset < end:
                raise CheckpointError(
                    f"{manifest_path}: a block of {name!r} in {parts[rank]['file']} at offset "
                    f"{offset} is not aligned to {ALIGNMENT} or overlaps the previous one"
                )
            end = offset + nbytes
        if end > parts[rank]["size"]:
            raise CheckpointError(
                f"{manifest_path}: blocks of {parts[rank]['file']} end at {end}, after its "
                f"recorded size {parts[rank]['size']}"
            )
    return out


class Files:
    """The part files of one checkpoint, opened when first needed (their size checked)."""

    def __init__(self, path: Path, sizes: dict[str, int]):
        self.path, self.sizes, self.fds = path, sizes, {}

    def __call__(self, file: str) -> int:
        if file not in self.fds:
            where = self.path / file
            try:
                fd = os.open(where, os.O_RDONLY)
            except OSError as exc:
                raise CheckpointError(f"{where}: checkpoint part unreadable ({exc})") from exc
            self.fds[file] = fd
            size = os.fstat(fd).st_size
            if size != self.sizes[file]:
                raise CheckpointError(
                    f"{where}: checkpoint part truncated or extended: {size} bytes, the "
                    f"manifest says {self.sizes[file]}"
                )
        return self.fds[file]

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)
        self.fds = {}


def _placed(host: np.ndarray, sharding) -> Any:
    import jax

    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def read_arrays(
    path: Path,
    arrays: dict[str, tuple[np.dtype, tuple, list]],
    sizes: dict[str, int],
    template: dict[str, Any],
    expected: dict[str, str],
) -> tuple[dict[str, Any], dict[str, str]]:
    """Each array of ``arrays`` (``layout``'s) read from the files under ``path`` as its
    template leaf (``template[name]``) is laid out:

    - sharded over several devices: only the regions this process's devices hold are read
      (:func:`.regions.needed`), and put on those devices at once;
    - on one device, or replicated: read whole and put there;
    - a host value (no sharding): read whole, kept on the host.

    Arrays are read and placed one after another, each host copy dropped once placed: a
    restore holds about one array more than the process's share of the state. An array read
    whole must have its manifest's version-3 digest (``expected[name]``, where recorded). Returns the arrays
    and the version-3 digests of those read whole (a sharded one's pieces are hashed once
    the whole state is placed: ``checkpoint.verify_placed``)."""
    import jax

    from .pieces import array_digest

    files = Files(path, sizes)
    out: dict[str, Any] = {}
    digests: dict[str, str] = {}
    try:
        for name, (dtype, shape, stored) in arrays.items():
            leaf = template.get(name)
            sharding = getattr(leaf, "sharding", None)
            needed = regions.needed(leaf) if leaf is not None else None
            try:
                if needed is None:
                    host, _ = regions.read(name, regions.whole(shape), dtype, stored, files)
                    digests[name] = array_digest(host)
                    if name in expected and digests[name] != expected[name]:
                        files = ", ".join(sorted({block.file for block in stored}))
                        raise CheckpointError(
                            f"{path}: digest mismatch for state array {name!r} (in {files})"
                        )
                    out[name] = host if sharding is None else _placed(host, sharding)
                else:
                    blocks = {
                        region: regions.read(name, region, dtype, stored, files)[0]
                        for region in needed
                    }
                    slices = regions.HostSlices(shape, dtype, blocks)
                    out[name] = jax.make_array_from_callback(shape, sharding, slices.__getitem__)
            except regions.RegionError as exc:
                raise CheckpointError(f"{path}/{exc}") from exc
            except OSError as exc:
                raise CheckpointError(f"{path}: state array {name!r} unreadable ({exc})") from exc
    finally:
        files.close()
    return out, digests
