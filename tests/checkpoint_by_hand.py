"""Checkpoints checked by hand, sharing no code with ``minifield.state``: formats 5's and 3's
data file from its definition in docs/training-loop.md (every array's C-order bytes at a
64-byte aligned offset of ``arrays.bin``, zeros between, offsets in the manifest; each
entry's ``digest``, the version-3 hash below, in format 5, its ``sha256`` in format 3), format 2's
``.npy`` files from numpy's published format, the version-2 complete-state hash from its
definition there (sha256 over one ``name|dtype|shape|sha256`` line per array, in name
order, each ``sha256`` that of the array's C-order bytes) and the version-3 one (the same
lines, each array's hash that of its pieces' sha256 digests: along an axis of size n,
gcd(n, 48) equal blocks; the pieces in C order of that grid, each piece's bytes in C
order), piece by piece with plain slicing."""

from __future__ import annotations

import hashlib
import itertools
import json
import math
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


def pieces_digest_by_hand(array) -> str:
    """An array's version-3 hash: sha256 of its pieces' sha256 digests, each piece cut out
    with a slice per axis (blocks of n / gcd(n, 48) along an axis of size n); an array
    without elements is one empty piece."""
    array = np.asarray(array)
    if array.size == 0:
        return hashlib.sha256(hashlib.sha256(b"").digest()).hexdigest()
    grid = [math.gcd(n, 48) for n in array.shape]
    sizes = [n // g for n, g in zip(array.shape, grid, strict=True)]
    joined = b""
    for corner in itertools.product(*(range(g) for g in grid)):
        piece = array[tuple(slice(k * b, (k + 1) * b) for k, b in zip(corner, sizes, strict=True))]
        joined += hashlib.sha256(np.ascontiguousarray(piece).tobytes()).digest()
    return hashlib.sha256(joined).hexdigest()


#: the formats whose entries hold each array's version-3 digest (format 4's blocks a sha256)
_BY_DIGEST = ("minifield-checkpoint/5", "minifield-checkpoint/4")


def _sha256(array) -> str:
    return hashlib.sha256(np.ascontiguousarray(array).tobytes()).hexdigest()


def array_hash_by_hand(array, version: int) -> str:
    if version == 2:
        return _sha256(array)
    return pieces_digest_by_hand(array)


def state_hash_by_hand(arrays: dict, version: int = 3) -> str:
    """The version-3 (or 2) complete-state hash of named arrays, from their bytes in memory."""
    lines = "".join(
        f"{array_line(name, arrays[name])}|{array_hash_by_hand(arrays[name], version)}\n"
        for name in sorted(arrays)
    )
    return hashlib.sha256(lines.encode()).hexdigest()


def _arrays_one_file(path: Path, manifest: dict) -> dict[str, tuple[np.ndarray, bytes]]:
    """``{name: (array, its bytes)}`` of a format-5 or 3 checkpoint, cut from the raw data
    file."""
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


def _arrays_v4(path: Path, manifest: dict) -> dict[str, tuple[np.ndarray, bytes]]:
    """``{name: (array, its bytes)}`` of a format-4 checkpoint (one part file per process that
    wrote it): every block cut from its raw part file, its sha256 checked, and put in place
    in an array of zeros whose every element must be written exactly once."""
    raws = [(path / part["file"]).read_bytes() for part in manifest["parts"]]
    for part, raw in zip(manifest["parts"], raws, strict=True):
        assert part["size"] == len(raw), part["file"]
    assert sorted(p.name for p in path.iterdir()) == sorted(
        ["manifest.json", *(part["file"] for part in manifest["parts"])]
    )
    out = {}
    for entry in manifest["arrays"]:
        dtype, shape = np.dtype(entry["dtype"]), tuple(entry["shape"])
        array, written = np.zeros(shape, dtype), np.zeros(shape, np.int64)
        for block in entry["blocks"]:
            offset, nbytes = block["offset"], block["nbytes"]
            assert offset % 64 == 0, entry["name"]
            data = raws[block["part"]][offset : offset + nbytes]
            assert hashlib.sha256(data).hexdigest() == block["sha256"], entry["name"]
            where = tuple(slice(a, b) for a, b in block["region"])
            block_shape = [b - a for a, b in block["region"]]
            count = int(np.prod(block_shape, dtype=np.int64))
            array[where] = np.frombuffer(data, dtype, count).reshape(block_shape)
            written[where] += 1
        assert (written == 1).all(), entry["name"]
        out[entry["name"]] = (array, array.tobytes())
    return out


def verify_checkpoint_by_hand(path: Path) -> tuple[dict, dict[str, np.ndarray]]:
    """(manifest, arrays) of a format-5, 4, 3 (or 2) checkpoint, every array's bytes hashed
    here against its entry (its pieces in formats 5 and 4) and the state hash rebuilt
    against the manifest's: from those hashes (version 2), or from the arrays' pieces
    (version 3)."""
    manifest = json.loads((path / "manifest.json").read_text())
    version = manifest["state_hash_version"]
    assert version in (2, 3) and (version, manifest["format"]) != (3, "minifield-checkpoint/2")
    assert version == 3 or manifest["format"] not in _BY_DIGEST
    read = {
        "minifield-checkpoint/5": _arrays_one_file,
        "minifield-checkpoint/4": _arrays_v4,
        "minifield-checkpoint/3": _arrays_one_file,
        "minifield-checkpoint/2": _arrays_v2,
    }
    stored = read[manifest["format"]](path, manifest)
    arrays, lines = {}, []
    for entry in manifest["arrays"]:
        array, data = stored[entry["name"]]
        sha = hashlib.sha256(data).hexdigest()
        if manifest["format"] in _BY_DIGEST:  # format 4's blocks: their sha256 above
            assert entry["digest"] == pieces_digest_by_hand(array), entry["name"]
            assert "sha256" not in entry, entry["name"]
        else:
            assert sha == entry["sha256"], entry["name"]
        assert array.dtype.str == entry["dtype"] and list(array.shape) == entry["shape"]
        arrays[entry["name"]] = array
        digest = sha if version == 2 else pieces_digest_by_hand(array)
        lines.append((entry["name"], f"{array_line(entry['name'], array)}|{digest}\n"))
    text = "".join(line for _, line in sorted(lines))
    assert manifest["state_hash"] == hashlib.sha256(text.encode()).hexdigest(), path
    return manifest, arrays


def rewrite_as_format_3(path: Path) -> None:
    """Turn a format-5 checkpoint directory into the format-3 checkpoint of the same state, as
    earlier releases wrote it: the same data file and version-3 state hash, each entry's
    ``digest`` replaced by the sha256 of its array's bytes."""
    manifest, arrays = verify_checkpoint_by_hand(path)
    assert manifest["format"] == "minifield-checkpoint/5", path
    entries = []
    for entry in manifest["arrays"]:
        kept = {key: value for key, value in entry.items() if key != "digest"}
        entries.append({**kept, "sha256": _sha256(arrays[entry["name"]])})
    old = {**manifest, "format": "minifield-checkpoint/3", "arrays": entries}
    (path / "manifest.json").write_text(json.dumps(old, indent=2, sort_keys=True) + "\n")


def rewrite_as_format_2(path: Path) -> None:
    """Turn a format-5 checkpoint directory into the format-2 checkpoint of the same state, as
    the release before format 3 wrote it: one ``np.save`` file per array
    (``arrays/00000.npy`` … in the manifest's order), entries naming their ``file`` and the
    sha256 of their array's bytes, the version-2 state hash of those (that release's), no
    ``data`` field."""
    manifest, arrays = verify_checkpoint_by_hand(path)
    assert manifest["format"] == "minifield-checkpoint/5", path
    (path / "arrays").mkdir()
    entries = []
    for index, entry in enumerate(manifest["arrays"]):
        file = f"arrays/{index:05d}.npy"
        np.save(path / file, arrays[entry["name"]], allow_pickle=False)
        kept = {key: entry[key] for key in ("name", "dtype", "shape")}
        entries.append({**kept, "sha256": _sha256(arrays[entry["name"]]), "file": file})
    (path / "arrays.bin").unlink()
    rest = {key: value for key, value in manifest.items() if key != "data"}
    old = {**rest, "format": "minifield-checkpoint/2", "arrays": entries}
    old |= {"state_hash": state_hash_by_hand(arrays, 2), "state_hash_version": 2}
    (path / "manifest.json").write_text(json.dumps(old, indent=2, sort_keys=True) + "\n")
