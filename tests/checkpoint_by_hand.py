"""Checkpoints checked by hand, sharing no code with ``minifield.state``: format 3's data file
from its definition in docs/training-loop.md (every array's C-order bytes at a 64-byte
aligned offset of ``arrays.bin``, zeros between, offsets in the manifest), format 2's
``.npy`` files from numpy's published format, the version-2 complete-state hash from its
definition there (sha256 over one ``name|dtype|shape|sha256`` line per array, in name
order, each ``sha256`` that of the array's C-order bytes)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np


def npy_data(file: Path) -> bytes:
    """A format-1.0 ``.npy`` file's bytes after its header: the 6-byte magic, 2 version
    bytes, a little-endian 2-byte header length, then the header."""
    raw = file.read_bytes()
    assert raw[:8] == b"\x93NUMPY\x01\x00", file
    return raw[10 + int.from_bytes(raw[8:10], "little") :]


def array_line(name: str, array) -> str:
    array = np.asarray(array)
    return f"{name}|{array.dtype.str}|{','.join(map(str, array.shape))}"


def state_hash_by_hand(arrays: dict) -> str:
    """The version-2 complete-state hash of named arrays, from their bytes in memory."""
    lines = "".join(
        f"{array_line(name, arrays[name])}|"
        f"{hashlib.sha256(np.ascontiguousarray(arrays[name]).tobytes()).hexdigest()}\n"
        for name in sorted(arrays)
    )
    return hashlib.sha256(lines.encode()).hexdigest()


def _arrays_v3(path: Path, manifest: dict) -> dict[str, tuple[np.ndarray, bytes]]:
    """``{name: (array, its bytes)}`` of a format-3 checkpoint, cut from the raw data file."""
    raw = (path / "arrays.bin").read_bytes()
    assert manifest["data"] == {"file": "arrays.bin", "size": len(raw), "alignment": 64}, path
    out, end = {}, 0
    for entry in manifest["arrays"]:
        offset, nbytes = entry["offset"], entry["nbytes"]
        assert offset % 64 == 0 and offset >= end and raw[end:offset] == bytes(offset - end)
        data = raw[offset : offset + nbytes]
        count = int(np.prod(entry["shape"], dtype=np.int64))
        array = np.frombuffer(data, np.dtype(entry["dtype"]), count).reshape(entry["shape"])
        out[entry["name"]], end = (array, data), offset + nbytes
    assert end == len(raw), path
    return out


def _arrays_v2(path: Path, manifest: dict) -> dict[str, tuple[np.ndarray, bytes]]:
    """``{name: (array, its bytes)}`` of a format-2 checkpoint, one ``.npy`` file each."""
    out = {}
    for entry in manifest["arrays"]:
        data = npy_data(path / entry["file"])
        array = np.load(path / entry["file"], allow_pickle=False)
        assert array.tobytes() == data, entry["file"]
        out[entry["name"]] = (array, data)
    return out


def verify_checkpoint_by_hand(path: Path) -> tuple[dict, dict[str, np.ndarray]]:
    """(manifest, arrays) of a format-3 (or format-2) checkpoint, every array's bytes hashed
    here against its entry and the state hash rebuilt from those hashes against the
    manifest's."""
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["state_hash_version"] == 2, path
    read = {"minifield-checkpoint/3": _arrays_v3, "minifield-checkpoint/2": _arrays_v2}
    stored = read[manifest["format"]](path, manifest)
    arrays, lines = {}, []
    for entry in manifest["arrays"]:
        array, data = stored[entry["name"]]
        sha = hashlib.sha256(data).hexdigest()
        assert sha == entry["sha256"], entry["name"]
        assert array.dtype.str == entry["dtype"] and list(array.shape) == entry["shape"]
        arrays[entry["name"]] = array
        lines.append((entry["name"], f"{array_line(entry['name'], array)}|{sha}\n"))
    text = "".join(line for _, line in sorted(lines))
    assert manifest["state_hash"] == hashlib.sha256(text.encode()).hexdigest(), path
    return manifest, arrays


def rewrite_as_format_2(path: Path) -> None:
    """Turn a format-3 checkpoint directory into the format-2 checkpoint of the same state, as
    the previous release wrote it: one ``np.save`` file per array (``arrays/00000.npy`` … in
    the manifest's order), entries naming their ``file``, the same per-array and state hashes
    (version 2 in both), no ``data`` field."""
    manifest, arrays = verify_checkpoint_by_hand(path)
    assert manifest["format"] == "minifield-checkpoint/3", path
    (path / "arrays").mkdir()
    entries = []
    for index, entry in enumerate(manifest["arrays"]):
        file = f"arrays/{index:05d}.npy"
        np.save(path / file, arrays[entry["name"]], allow_pickle=False)
        kept = {key: entry[key] for key in ("name", "dtype", "shape", "sha256")}
        entries.append({**kept, "file": file})
    (path / "arrays.bin").unlink()
    rest = {key: value for key, value in manifest.items() if key != "data"}
    old = {**rest, "format": "minifield-checkpoint/2", "arrays": entries}
    (path / "manifest.json").write_text(json.dumps(old, indent=2, sort_keys=True) + "\n")
