"""Atomic, verifiable checkpoints of the complete training state (no pickle).

Layout of one committed checkpoint::

    checkpoints/step-00000004/
        manifest.json            written last; its presence means "committed"
        arrays/00000.npy ...     one .npy per state leaf (allow_pickle=False)

A checkpoint is written into a temporary sibling directory, every file is
fsynced, the directory is renamed into place and the parent fsynced. A reader
verifies every array's sha256, shape and dtype against the manifest and the
recomputed state hash against the recorded one; anything that fails is never
used.
"""

from __future__ import annotations

import io
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from . import atomic
from .digest import sha256_bytes, sha256_file
from .state import named_arrays, restore_like, state_hash

FORMAT = "minifield-checkpoint/1"
MANIFEST = "manifest.json"


class CheckpointError(Exception):
    """A checkpoint that cannot be trusted (missing, corrupt, or of another computation)."""


@dataclass(frozen=True)
class Committed:
    step: int
    path: Path
    sha256: str  # sha256 of the manifest file: names this exact checkpoint
    state_hash: str
    seconds: float
    manifest: dict


def step_dir_name(step: int) -> str:
    return f"step-{step:08d}"


def _npy_bytes(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, np.asarray(array, order="C"), allow_pickle=False)
    return buffer.getvalue()


def _write_synced(path: Path, data: bytes) -> None:
    with open(path, "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())


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
) -> Committed:
    """Commit ``state`` as checkpoint ``step``; refuse a step not above the last committed one.

    ``before_commit`` (fault injection only) is called once the arrays are written, before
    the manifest and the rename that commit the checkpoint.
    """
    started = time.monotonic()
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
    (tmp / "arrays").mkdir(parents=True)
    arrays = named_arrays(state)
    entries = []
    for index, (name, array) in enumerate(sorted(arrays.items())):
        data = _npy_bytes(array)
        file = f"arrays/{index:05d}.npy"
        _write_synced(tmp / file, data)
        entries.append(
            {
                "name": name,
                "file": file,
                "dtype": array.dtype.str,
                "shape": list(array.shape),
                "sha256": sha256_bytes(data),
            }
        )
    manifest = {
        "format": FORMAT,
        "step": step,
        "computation_digest": computation_digest,
        "state_hash": state_hash(state),
        "arrays": entries,
        "extra": extra or {},
    }
    atomic.fsync_dir(tmp / "arrays")
    if before_commit is not None:
        before_commit()
    atomic.write_json(tmp / MANIFEST, manifest)
    os.rename(tmp, final)
    atomic.fsync_dir(directory)
    if keep is not None:
        prune(directory, keep)
    return Committed(
        step=step,
        path=final,
        sha256=sha256_file(final / MANIFEST),
        state_hash=manifest["state_hash"],
        seconds=time.monotonic() - started,
        manifest=manifest,
    )


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
