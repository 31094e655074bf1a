"""Atomic, verifiable checkpoints of the complete training state (no pickle).

Layout of one committed checkpoint::

    checkpoints/step-00000004/
        manifest.json            written last; its presence means "committed"
        arrays/00000.npy ...     one .npy per state leaf (allow_pickle=False)

A checkpoint is written into a temporary sibling directory, every file is
fsynced, the directory is renamed into place and the parent fsynced. Each array's
bytes are hashed while they are written (or not at all when the caller hashed that
very state already), and the state hash (version 2, :data:`~.arrays.STATE_HASH_VERSION`)
is the hash of those per-array hashes: every byte is hashed once. A reader verifies each
file's ``.npy`` header against the manifest's dtype and shape, the sha256 of its bytes,
and the state hash recomputed from them against the recorded one; anything that fails is
never used.

Format ``minifield-checkpoint/2`` (this one): an entry's ``sha256`` is that of the array's
bytes (the file after its ``.npy`` header), and the manifest's ``state_hash`` is of
version 2 (``state_hash_version: 2``). Checkpoints of format ``minifield-checkpoint/1``
(an entry's ``sha256`` of the whole file, a version-1 state hash) are still read and
verified as they were written.
"""

from __future__ import annotations

import hashlib
import io
import os
import shutil
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from numpy.lib import format as npy_format

from .. import atomic
from ..digest import sha256_bytes, sha256_file
from .arrays import (
    STATE_HASH_VERSION,
    array_sha256,
    byte_view,
    hash_named_arrays,
    named_arrays,
    restore_like,
    state_hash,
)

FORMAT = "minifield-checkpoint/2"
#: formats read and verified: format -> the state-hash version of its manifests
STATE_HASH_VERSION_OF = {"minifield-checkpoint/1": 1, FORMAT: STATE_HASH_VERSION}
MANIFEST = "manifest.json"
#: bytes hashed and written at a time (a chunk stays in cache between the two)
_CHUNK = 4 << 20
#: threads writing array files at once
_WRITERS = max(2, min(8, os.cpu_count() or 2))


class CheckpointError(Exception):
    """A checkpoint that cannot be trusted (missing, corrupt, or of another computation)."""


@dataclass(frozen=True)
class CheckpointRecord:
    """One committed checkpoint: the one record of it (a commit, a restore, ``result.json``).

    ``sha256`` is that of its manifest file, which names this exact checkpoint. ``path`` and
    ``sha256`` are None on processes other than 0, which take part in a commit but do not
    write it; ``state_hash`` is None where it is not known (read back from a ``result.json``).
    """

    step: int
    path: str | None
    sha256: str | None
    state_hash: str | None = None

    def as_dict(self) -> dict[str, Any]:
        """What ``result.json`` and the receipts record: step, path and manifest sha256."""
        return {"step": self.step, "path": self.path, "sha256": self.sha256}

    @classmethod
    def from_dict(cls, value: dict | None) -> CheckpointRecord | None:
        if value is None:
            return None
        return cls(step=value["step"], path=value.get("path"), sha256=value.get("sha256"))


def step_dir_name(step: int) -> str:
    return f"step-{step:08d}"


def _npy_header(array: np.ndarray) -> bytes:
    """The ``.npy`` header ``np.save`` writes for ``array`` (format 1.0: our names and shapes
    always fit), so a file is written from the array's own memory without a serialised copy."""
    buffer = io.BytesIO()
    npy_format.write_array_header_1_0(buffer, npy_format.header_data_from_array_1_0(array))
    return buffer.getvalue()


def _write_array(path: Path, array: np.ndarray, known_sha256: str | None) -> str:
    """Write ``array`` as an ``.npy`` file and fsync it, hashing its bytes as they are
    written unless ``known_sha256`` is given; returns the sha256 of the array's bytes. An
    error names the file."""
    header, data = _npy_header(array), byte_view(array)
    digest = None if known_sha256 else hashlib.sha256()
    with atomic.naming(path), open(path, "wb") as handle:
        handle.write(header)
        for start in range(0, data.size, _CHUNK):
            chunk = data[start : start + _CHUNK]
            if digest is not None:
                digest.update(chunk)
            handle.write(chunk)
        handle.flush()
        os.fsync(handle.fileno())
    return known_sha256 or digest.hexdigest()


def committed_steps(directory: Path) -> list[int]:
    """Steps of committed (manifest present) checkpoints in ``directory``, ascending."""
    if not directory.is_dir():
        return []
    steps = []
    for entry in directory.iterdir():
        if entry.name.startswith("step-") and (entry / MANIFEST).is_file():
            try:
                steps.append(int(entry.name.removeprefix("step-")))
            except ValueError:
                continue
    return sorted(steps)


def save(
    directory: Path,
    state: Any,
    *,
    step: int,
    computation_digest: str,
    extra: dict | None = None,
    keep: int | None = None,
    before_commit=None,
    known_digests: dict[str, str] | None = None,
) -> CheckpointRecord:
    """Commit ``state`` as checkpoint ``step``; refuse a step not above the last committed one.

    One pass over the bytes: each array is hashed while its file is written (several files
    at once) and the complete-state hash is the hash of those per-array hashes;
    ``known_digests`` (``{name: array_sha256}``, when the caller hashed this very state
    already) spares even that pass. Durability: every file fsynced, then the directories,
    then the rename, then the parent.

    ``before_commit`` (fault injection only) is called once the arrays are written, before
    the manifest and the rename that commit the checkpoint. On any error the temporary
    directory is removed (best effort) and the previous checkpoints are untouched.
    """
    directory.mkdir(parents=True, exist_ok=True)
    existing = committed_steps(directory)
    if existing and step <= existing[-1]:
        raise CheckpointError(
            f"checkpoint step {step} is not greater than the last committed step {existing[-1]} "
            f"in {directory}"
        )
    final = directory / step_dir_name(step)
    tmp = directory / f".tmp-{step_dir_name(step)}-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    try:
        (tmp / "arrays").mkdir(parents=True)
        manifest, manifest_bytes = _write_contents(
            tmp, named_arrays(state), step, computation_digest, extra, known_digests
        )
        if before_commit is not None:
            before_commit()
        with atomic.naming(tmp / MANIFEST), open(tmp / MANIFEST, "wb") as handle:
            handle.write(manifest_bytes)
            handle.flush()
            os.fsync(handle.fileno())
        atomic.fsync_dir(tmp)
        os.rename(tmp, final)
        atomic.fsync_dir(directory)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if keep is not None:
        prune(directory, keep)
    return CheckpointRecord(
        step=step,
        path=str(final),
        sha256=sha256_bytes(manifest_bytes),
        state_hash=manifest["state_hash"],
    )


def _write_contents(
    tmp: Path,
    arrays: dict[str, np.ndarray],
    step: int,
    computation_digest: str,
    extra: dict | None,
    known_digests: dict[str, str] | None,
) -> tuple[dict, bytes]:
    """Write and fsync every array file under ``tmp/arrays``; return the manifest (and its
    bytes as ``atomic.write_json`` would write them)."""
    items = sorted(arrays.items())
    files = [f"arrays/{index:05d}.npy" for index in range(len(items))]
    known = known_digests or {}
    # hashlib, file writes and fsync release the GIL: the arrays are written (each hashed as
    # it goes, each fsynced) by several threads
    with ThreadPoolExecutor(max_workers=_WRITERS, thread_name_prefix="checkpoint") as pool:
        writes = [
            pool.submit(_write_array, tmp / file, array, known.get(name))
            for file, (name, array) in zip(files, items, strict=True)
        ]
        entries = [
            {
                "name": name,
                "file": file,
                "dtype": array.dtype.str,
                "shape": list(array.shape),
                "sha256": write.result(),
            }
            for file, (name, array), write in zip(files, items, writes, strict=True)
        ]
    digests = {entry["name"]: entry["sha256"] for entry in entries}
    atomic.fsync_dir(tmp / "arrays")
    manifest = {
        "format": FORMAT,
        "step": step,
        "computation_digest": computation_digest,
        "state_hash": hash_named_arrays(items, digests=digests),
        "state_hash_version": STATE_HASH_VERSION,
        "arrays": entries,
        "extra": extra or {},
    }
    return manifest, atomic.json_bytes(manifest)


def prune(directory: Path, keep: int) -> None:
    """Keep the newest ``keep`` committed checkpoints; drop older ones and stale temporaries."""
    steps = committed_steps(directory)
    for step in steps[:-keep] if keep < len(steps) else []:
        shutil.rmtree(directory / step_dir_name(step), ignore_errors=True)
    for entry in directory.iterdir():
        if entry.name.startswith(".tmp-"):
            shutil.rmtree(entry, ignore_errors=True)


def _read_manifest(path: Path, computation_digest: str | None) -> dict:
    manifest_path = path / MANIFEST
    if not manifest_path.is_file():
        raise CheckpointError(f"{path}: no {MANIFEST} (checkpoint never committed)")
    try:
        manifest = atomic.read_json(manifest_path)
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{manifest_path}: unreadable manifest ({exc})") from exc
    version = STATE_HASH_VERSION_OF.get(manifest.get("format"))
    if version is None:
        raise CheckpointError(
            f"{manifest_path}: format {manifest.get('format')!r}, expected one of "
            f"{sorted(STATE_HASH_VERSION_OF)}"
        )
    if manifest.get("state_hash_version", 1) != version:
        raise CheckpointError(
            f"{manifest_path}: state_hash_version {manifest.get('state_hash_version')!r}, "
            f"expected {version} for format {manifest['format']!r}"
        )
    if computation_digest is not None and manifest.get("computation_digest") != computation_digest:
        raise CheckpointError(
            f"{manifest_path}: checkpoint belongs to computation "
            f"{manifest.get('computation_digest')}, not {computation_digest}"
        )
    return manifest


def _read_array(file: Path, entry: dict) -> np.ndarray:
    """One array of a format-2 checkpoint: its ``.npy`` header must give the manifest's
    dtype and shape, its bytes (exactly that many) the manifest's sha256."""
    try:
        with open(file, "rb") as handle:
            magic = npy_format.read_magic(handle)
            read_header = (
                npy_format.read_array_header_1_0
                if magic == (1, 0)
                else npy_format.read_array_header_2_0
            )
            shape, fortran_order, dtype = read_header(handle)
            if fortran_order or dtype.hasobject or dtype.str != entry["dtype"]:
                raise CheckpointError(
                    f"{file}: .npy header says {dtype.str} (fortran_order {fortran_order}), "
                    f"the manifest {entry['dtype']} in C order"
                )
            if list(shape) != entry["shape"]:
                raise CheckpointError(
                    f"{file}: .npy header says shape {list(shape)}, the manifest {entry['shape']}"
                )
            array = np.empty(shape, dtype)
            data = byte_view(array)
            got, more = handle.readinto(data), handle.read(1)
    except OSError as exc:
        raise CheckpointError(f"{file}: unreadable ({exc})") from exc
    except ValueError as exc:
        raise CheckpointError(f"{file}: not a valid .npy array ({exc})") from exc
    if got != data.size or more:
        raise CheckpointError(
            f"{file}: truncated or extended: {got}{'+' if more else ''} bytes after the .npy "
            f"header, expected {data.size} for state array {entry['name']!r}"
        )
    if array_sha256(array) != entry["sha256"]:
        raise CheckpointError(f"{file}: sha256 mismatch for state array {entry['name']!r}")
    return array


def _read_array_v1(file: Path, entry: dict) -> np.ndarray:
    """One array of a format-1 checkpoint: the manifest's sha256 is of the whole file."""
    try:
        data = file.read_bytes()
    except OSError as exc:
        raise CheckpointError(f"{file}: unreadable ({exc})") from exc
    if sha256_bytes(data) != entry["sha256"]:
        raise CheckpointError(f"{file}: sha256 mismatch for state array {entry['name']!r}")
    try:
        array = np.load(io.BytesIO(data), allow_pickle=False)
    except ValueError as exc:
        raise CheckpointError(f"{file}: not a valid .npy array ({exc})") from exc
    if array.dtype.str != entry["dtype"] or list(array.shape) != entry["shape"]:
        raise CheckpointError(f"{file}: dtype/shape differ from the manifest")
    return array


def load(path: Path, template: Any, *, computation_digest: str | None = None) -> tuple[Any, dict]:
    """Verify and restore one checkpoint directory (either format). Raises CheckpointError on
    any mismatch. The state hash is recomputed in the manifest's own version: a version-2
    one from the per-array hashes just verified against the bytes read."""
    manifest = _read_manifest(path, computation_digest)
    version = STATE_HASH_VERSION_OF[manifest["format"]]
    read = _read_array_v1 if version == 1 else _read_array
    entries = manifest.get("arrays", [])
    arrays = {entry["name"]: read(path / entry["file"], entry) for entry in entries}
    try:
        state = restore_like(template, arrays)
    except ValueError as exc:
        raise CheckpointError(f"{path}: {exc}") from exc
    if version == 1:
        recomputed = state_hash(state, version=1)
    else:
        digests = {entry["name"]: entry["sha256"] for entry in entries}
        recomputed = hash_named_arrays(sorted(arrays.items()), digests=digests)
    if recomputed != manifest.get("state_hash"):
        raise CheckpointError(f"{path}: restored state hash differs from the manifest")
    return state, manifest


def manifest_sha256(path: Path) -> str:
    return sha256_file(path / MANIFEST)
