"""Atomic, verifiable checkpoints of the complete training state (no pickle).

Layout of one committed checkpoint::

    checkpoints/step-00000004/
        manifest.json            written last; its presence means "committed"
        arrays/00000.npy ...     one .npy per state leaf (allow_pickle=False)

A checkpoint is written into a temporary sibling directory, every file is
fsynced, the directory is renamed into place and the parent fsynced. Each array
file is hashed while it is written (no second pass over the bytes); the state hash
is computed alongside, or taken from the caller when it hashed that state already. A reader
verifies every array's sha256, shape and dtype against the manifest and the
recomputed state hash against the recorded one; anything that fails is never
used.
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
from .arrays import byte_view, hash_named_arrays, named_arrays, restore_like, state_hash

FORMAT = "minifield-checkpoint/1"
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


def _write_array(path: Path, array: np.ndarray) -> str:
    """Write ``array`` as an ``.npy`` file and fsync it, hashing the bytes as they are
    written; returns the file's sha256. An error names the file."""
    header, data = _npy_header(array), byte_view(array)
    digest = hashlib.sha256(header)
    with atomic.naming(path), open(path, "wb") as handle:
        handle.write(header)
        for start in range(0, data.size, _CHUNK):
            chunk = data[start : start + _CHUNK]
            digest.update(chunk)
            handle.write(chunk)
        handle.flush()
        os.fsync(handle.fileno())
    return digest.hexdigest()


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
    known_state_hash: str | None = None,
) -> CheckpointRecord:
    """Commit ``state`` as checkpoint ``step``; refuse a step not above the last committed one.

    One pass over the bytes: each array file is hashed while it is written, its fsync runs
    on a second thread while the next file is written, and the complete-state hash is
    computed on a third (``known_state_hash``, when the caller hashed this very state
    already, spares it). Durability is that of before: every file fsynced, then the
    directories, then the rename, then the parent.

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
            tmp, named_arrays(state), step, computation_digest, extra, known_state_hash
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
    known_state_hash: str | None,
) -> tuple[dict, bytes]:
    """Write and fsync every array file under ``tmp/arrays``; return the manifest (and its
    bytes as ``atomic.write_json`` would write them)."""
    items = sorted(arrays.items())
    files = [f"arrays/{index:05d}.npy" for index in range(len(items))]
    # hashlib, file writes and fsync release the GIL: the arrays are written (each hashed as
    # it goes, each fsynced) by several threads, the state hash computed by one more
    with ThreadPoolExecutor(max_workers=_WRITERS + 1, thread_name_prefix="checkpoint") as pool:
        hashing = None if known_state_hash else pool.submit(hash_named_arrays, items)
        writes = [
            pool.submit(_write_array, tmp / file, array)
            for file, (_, array) in zip(files, items, strict=True)
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
        state_hash_value = known_state_hash or hashing.result()
    atomic.fsync_dir(tmp / "arrays")
    manifest = {
        "format": FORMAT,
        "step": step,
        "computation_digest": computation_digest,
        "state_hash": state_hash_value,
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


def load(path: Path, template: Any, *, computation_digest: str | None = None) -> tuple[Any, dict]:
    """Verify and restore one checkpoint directory. Raises CheckpointError on any mismatch."""
    manifest_path = path / MANIFEST
    if not manifest_path.is_file():
        raise CheckpointError(f"{path}: no {MANIFEST} (checkpoint never committed)")
    try:
        manifest = atomic.read_json(manifest_path)
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{manifest_path}: unreadable manifest ({exc})") from exc
    if manifest.get("format") != FORMAT:
        raise CheckpointError(
            f"{manifest_path}: format {manifest.get('format')!r}, expected {FORMAT!r}"
        )
    if computation_digest is not None and manifest.get("computation_digest") != computation_digest:
        raise CheckpointError(
            f"{manifest_path}: checkpoint belongs to computation "
            f"{manifest.get('computation_digest')}, not {computation_digest}"
        )
    arrays = {}
    for entry in manifest.get("arrays", []):
        file = path / entry["file"]
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
        arrays[entry["name"]] = array
    try:
        state = restore_like(template, arrays)
    except ValueError as exc:
        raise CheckpointError(f"{path}: {exc}") from exc
    if state_hash(state) != manifest.get("state_hash"):
        raise CheckpointError(f"{path}: restored state hash differs from the manifest")
    return state, manifest


def manifest_sha256(path: Path) -> str:
    return sha256_file(path / MANIFEST)
