"""Atomic, verifiable checkpoints of the complete training state (no pickle).

Layout of one committed checkpoint (format ``minifield-checkpoint/5``)::

    checkpoints/step-00000004/
        arrays.bin               every state array at an aligned offset (.checkpoint_data)
        manifest.json            written last; its presence means "committed"

A checkpoint is written into a temporary sibling directory: the data file is written
sequentially and fsynced; then the manifest (offsets, dtypes, shapes, each array's
version-3 digest, the state hash) is written and fsynced, the directory fsynced, renamed
into place and the parent fsynced. An array's digest (:func:`.pieces.array_digest`) is both
its integrity check and its part of the state hash (version 3,
:data:`~.arrays.STATE_HASH_VERSION`): taken from a hashed update of that step, or hashed
from the arrays while the file is written, so each byte is hashed at most once. A reader
maps the data file, checks the layout, each array's digest and the state hash recomputed
from them against the recorded one; anything that fails is never used.

Checkpoints of earlier releases are still read and verified as they were written: format
``minifield-checkpoint/3`` (the same data file, each entry's ``sha256`` of its bytes, a
version-3 state hash, or a version-2 one rebuilt from those sha256), format 4 (several
processes' parts, :mod:`.checkpoint_parts`, still written by them), and
(:mod:`.checkpoint_npy`) format ``minifield-checkpoint/2`` (one ``.npy`` per array, the same
per-array hashes and version-2 state hash) and ``minifield-checkpoint/1`` (an entry's
``sha256`` of the whole file, a version-1 state hash).
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import numpy as np

from .. import atomic
from ..digest import sha256_bytes, sha256_file
from . import checkpoint_data, checkpoint_npy, checkpoint_parts, regions
from .arrays import (
    STATE_HASH_VERSION,
    array_digests,
    hash_named_arrays,
    named_leaves,
    restore_like,
    state_hash,
    to_host,
)
from .checkpoint_data import CheckpointError

#: written by one process (the whole state in one data file, each array checked by its
#: version-3 digest)
FORMAT = "minifield-checkpoint/5"
#: the same data file, each array checked by the sha256 of its bytes (read only: written
#: by earlier releases, with state-hash version 2, then 3)
FORMAT_SHA256 = "minifield-checkpoint/3"
#: written by several processes, each its own part (:mod:`.checkpoint_parts`)
FORMAT_PARTS = checkpoint_parts.FORMAT
#: the one-file formats: format -> the field of an entry that checks its array
ONE_FILE = {FORMAT: checkpoint_data.DIGEST, FORMAT_SHA256: checkpoint_data.SHA256}
#: formats read and verified: format -> the state-hash versions its manifests may hold
STATE_HASH_VERSIONS_OF = {
    "minifield-checkpoint/1": (1,),
    "minifield-checkpoint/2": (2,),
    FORMAT_SHA256: (2, STATE_HASH_VERSION),
    FORMAT_PARTS: (STATE_HASH_VERSION,),
    FORMAT: (STATE_HASH_VERSION,),
}
MANIFEST = "manifest.json"

__all__ = [
    "CheckpointError",
    "CheckpointRecord",
    "FORMAT",
    "FORMAT_PARTS",
    "FORMAT_SHA256",
    "MANIFEST",
    "load",
    "save",
    "verify_placed",
]


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

    Copied to the host (:func:`host_copies`), then array by array written into the one data
    file; each array's version-3 digest (the manifest's integrity check, and what the
    complete-state hash is the hash of) is taken from ``known_digests`` (``{name:
    pieces.array_digest}``, when the caller hashed this very state already: nothing is
    hashed here) or hashed while the file is written. Durability: the data file fsynced,
    then the manifest, then the directory, then the rename, then the parent.

    ``before_commit`` (fault injection only) is called once the data file is written, before
    the manifest and the rename that commit the checkpoint. On any error the temporary
    directory is removed (best effort) and the previous checkpoints are untouched.
    """
    check_step(directory, step)
    final = directory / step_dir_name(step)
    tmp = directory / f".tmp-{step_dir_name(step)}-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    try:
        tmp.mkdir()
        manifest, manifest_bytes = _write_contents(
            tmp, state, step, computation_digest, extra, known_digests
        )
        if before_commit is not None:
            before_commit()
        commit_directory(tmp, final, manifest_bytes)
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


def check_step(directory: Path, step: int) -> None:
    """Create ``directory``; refuse a step not above its newest committed checkpoint."""
    directory.mkdir(parents=True, exist_ok=True)
    existing = committed_steps(directory)
    if existing and step <= existing[-1]:
        raise CheckpointError(
            f"checkpoint step {step} is not greater than the last committed step {existing[-1]} "
            f"in {directory}"
        )


def commit_directory(tmp: Path, final: Path, manifest_bytes: bytes) -> None:
    """Commit the written directory ``tmp`` as ``final``: the manifest fsynced, then the
    directory, the rename, the parent."""
    with atomic.naming(tmp / MANIFEST), open(tmp / MANIFEST, "wb") as handle:
        handle.write(manifest_bytes)
        handle.flush()
        os.fsync(handle.fileno())
    atomic.fsync_dir(tmp)
    os.rename(tmp, final)
    atomic.fsync_dir(final.parent)


def _write_contents(
    tmp: Path,
    state: Any,
    step: int,
    computation_digest: str,
    extra: dict | None,
    known_digests: dict[str, str] | None,
) -> tuple[dict, bytes]:
    """Write and fsync the data file under ``tmp``; return the manifest (and its bytes as
    ``atomic.write_json`` would write them)."""
    leaves = named_leaves(state)
    entries = checkpoint_data.write(
        tmp / checkpoint_data.DATA_FILE,
        host_copies(leaves),
        check=checkpoint_data.DIGEST,
        known=known_digests,
    )
    digests = {entry["name"]: entry[checkpoint_data.DIGEST] for entry in entries}
    manifest = {
        "format": FORMAT,
        "step": step,
        "computation_digest": computation_digest,
        "state_hash": hash_named_arrays(leaves, digests=digests),
        "state_hash_version": STATE_HASH_VERSION,
        "data": checkpoint_data.description(entries),
        "arrays": entries,
        "extra": extra or {},
    }
    return manifest, encode_manifest(manifest)


def host_copies(leaves: list[tuple[str, Any]]) -> list[tuple[str, np.ndarray]]:
    """``(name, host array)`` of ``leaves``, every one on the host before the first is hashed
    or written: every device array's copy started at once, then each awaited. On the chip a
    commit that copied beside its hashing and writes took as long, with more CPU (the
    copy's runtime threads and the hashing threads on the same cores; docs/tpu.md,
    "Checkpoints on the chip"). On the CPU backend a host copy is a view. An array spread over
    processes is gathered (``to_host``) in turn, on this thread."""
    for _name, leaf in leaves:
        if isinstance(leaf, jax.Array) and leaf.is_fully_addressable:
            leaf.copy_to_host_async()
    return [
        (name, leaf if isinstance(leaf, np.ndarray) else to_host(leaf)) for name, leaf in leaves
    ]


def encode_manifest(manifest: dict) -> bytes:
    """The manifest as JSON, one line per array entry: as readable as an indented file, and
    written by json's C encoder (an indented dump of 161 entries took more CPU than writing
    the data file of a 39 MB state)."""
    rest = {k: v for k, v in manifest.items() if k != "arrays"}
    head = json.dumps(rest, indent=2, sort_keys=True, allow_nan=False)
    lines = ",\n".join(
        "    " + json.dumps(entry, sort_keys=True, allow_nan=False) for entry in manifest["arrays"]
    )
    # "arrays" sorts first: the same key order as an indented, sorted dump
    body = head.removeprefix("{\n")
    return ('{\n  "arrays": [\n' + lines + "\n  ],\n" + body + "\n").encode()


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
    versions = STATE_HASH_VERSIONS_OF.get(manifest.get("format"))
    if versions is None:
        raise CheckpointError(
            f"{manifest_path}: format {manifest.get('format')!r}, expected one of "
            f"{sorted(STATE_HASH_VERSIONS_OF)}"
        )
    if manifest.get("state_hash_version", 1) not in versions:
        expected = " or ".join(map(str, versions))
        raise CheckpointError(
            f"{manifest_path}: state_hash_version {manifest.get('state_hash_version')!r}, "
            f"expected {expected} for format {manifest['format']!r}"
        )
    if computation_digest is not None and manifest.get("computation_digest") != computation_digest:
        raise CheckpointError(
            f"{manifest_path}: checkpoint belongs to computation "
            f"{manifest.get('computation_digest')}, not {computation_digest}"
        )
    return manifest


def load(path: Path, template: Any, *, computation_digest: str | None = None) -> tuple[Any, dict]:
    """Verify and restore one checkpoint directory (any format read). Raises CheckpointError on
    any mismatch. The state hash is recomputed in the manifest's own version: a version-2
    one from the per-array hashes just verified against the bytes read, a version-3 one
    from the pieces of the arrays read (in format 5, the digests just verified).

    A template leaf sharded over several devices (a state created in its sharding, or an
    abstract ``ShapeDtypeStruct`` with a sharding) is read only for the regions this
    process's devices hold and put on them (a version-3 checkpoint of any format, written by
    any number of processes: :func:`.checkpoint_parts.read_arrays`). Each stored block, or
    array, read whole is checked against its sha256 or digest here; the complete state hash
    of such a state needs every process's pieces: the caller checks it with
    :func:`verify_placed` once every process restored (``manifest["sliced"]``)."""
    manifest = _read_manifest(path, computation_digest)
    version = manifest.get("state_hash_version", 1)
    leaves = dict(named_leaves(template)) if version == STATE_HASH_VERSION else {}
    sliced = any(regions.needed(leaf) is not None for leaf in leaves.values())
    digests = None
    check = ONE_FILE.get(manifest["format"])
    if manifest["format"] == FORMAT_PARTS or (check is not None and sliced):
        if manifest["format"] == FORMAT_PARTS:
            stored = checkpoint_parts.layout(path / MANIFEST, manifest)
            sizes = {part["file"]: part["size"] for part in manifest["parts"]}
        else:
            stored = checkpoint_data.blocks(path / MANIFEST, manifest, check)
            sizes = {checkpoint_data.DATA_FILE: manifest["data"]["size"]}
        expected = {e["name"]: e["digest"] for e in manifest["arrays"] if "digest" in e}
        arrays, digests = checkpoint_parts.read_arrays(path, stored, sizes, leaves, expected)
    elif check is not None:
        arrays = checkpoint_data.read(path, path / MANIFEST, manifest, check)
    else:
        arrays = checkpoint_npy.read(path, manifest, version)
    entries = manifest.get("arrays", [])
    if check == checkpoint_data.DIGEST:  # each verified against the bytes read
        digests = {entry["name"]: entry[check] for entry in entries}
    try:
        state = restore_like(template, arrays)
    except ValueError as exc:
        raise CheckpointError(f"{path}: {exc}") from exc
    if sliced:
        # the hash needs every piece: each process hashes its own once the state is placed
        return state, {**manifest, "sliced": True}
    if version == 1:
        recomputed = state_hash(state, version=1)
    elif version == 3:
        digests = digests if digests is not None else array_digests(arrays)
        recomputed = hash_named_arrays(sorted(arrays.items()), digests=digests)
    else:
        digests = {entry["name"]: entry["sha256"] for entry in entries}
        recomputed = hash_named_arrays(sorted(arrays.items()), digests=digests)
    if recomputed != manifest.get("state_hash"):
        raise CheckpointError(f"{path}: restored state hash differs from the manifest")
    return state, manifest


def verify_placed(state: Any, path: str | None, expected: str) -> None:
    """The state restored by slices, once placed, must hash to its manifest's state hash (a
    collective over the processes: each hashes the pieces it holds, only digests exchanged)."""
    if state_hash(state) != expected:
        raise CheckpointError(
            f"{path or 'the restored checkpoint'}: the placed state's hash differs from the "
            f"manifest's {expected} (a part holds other values than were written)"
        )


def manifest_sha256(path: Path) -> str:
    return sha256_file(path / MANIFEST)
