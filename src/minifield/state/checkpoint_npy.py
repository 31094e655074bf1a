"""Readers of the checkpoint formats of earlier releases: one ``.npy`` file per state array
(``arrays/00000.npy`` …, named by each manifest entry's ``file``).

- ``minifield-checkpoint/2``: an entry's ``sha256`` is that of the array's bytes (the file
  after its ``.npy`` header), whose header must give the entry's dtype and shape;
- ``minifield-checkpoint/1``: an entry's ``sha256`` is that of the whole file.

Both are read and verified as they were written; nothing writes them any more.
"""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
from numpy.lib import format as npy_format

from ..digest import sha256_bytes
from .arrays import array_sha256, byte_view
from .checkpoint_data import CheckpointError


def read_array_v2(file: Path, entry: dict) -> np.ndarray:
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


def read_array_v1(file: Path, entry: dict) -> np.ndarray:
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


def read(path: Path, manifest: dict, version: int) -> dict[str, np.ndarray]:
    """Every array of a format-1 (``version`` 1) or format-2 checkpoint directory."""
    read_one = read_array_v1 if version == 1 else read_array_v2
    return {entry["name"]: read_one(path / entry["file"], entry) for entry in manifest["arrays"]}
