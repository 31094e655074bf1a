"""Prepared examples: arrays (``.npy``, memory-mappable) plus a manifest, addressed by the examples digest.

Recipes with equal data settings share one prepared directory
(``results/examples/{edigest}/``); training verifies the manifest's digest and
every array's sha256 before using them (the files hashed side by side, one thread each).
The same format holds the other array products (a quantized base,
:mod:`minifield.hf.quantized_base`): ``digest_key`` names the manifest field of its address.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from .. import atomic
from ..digest import sha256_file

MANIFEST = "manifest.json"
FORMAT = "minifield-examples/1"


class ExamplesError(Exception):
    pass


def write(
    directory: Path,
    arrays: dict[str, np.ndarray] | Iterable[tuple[str, np.ndarray]],
    meta: dict[str, Any],
    examples_digest: str,
    *,
    digest_key: str = "examples_digest",
    kind: str = FORMAT,
) -> dict:
    """Write arrays, then the manifest last (its presence means the directory is complete).
    ``arrays``: a mapping (written in name order) or ``(name, array)`` pairs, each written
    as it comes, so a product larger than memory holds one array at a time."""
    directory.mkdir(parents=True, exist_ok=True)
    entries = []
    items = sorted(arrays.items()) if isinstance(arrays, dict) else arrays
    for name, array in items:
        file = f"{name}.npy"
        tmp = directory / f".{file}.tmp"
        np.save(tmp, np.asarray(array, order="C"), allow_pickle=False)
        # np.save appends .npy to names without it
        written = tmp if tmp.exists() else Path(str(tmp) + ".npy")
        written.replace(directory / file)
        entries.append(
            {
                "name": name,
                "file": file,
                "dtype": array.dtype.str,
                "shape": list(array.shape),
                "sha256": sha256_file(directory / file),
            }
        )
    manifest = {
        "format": kind,
        digest_key: examples_digest,
        "arrays": entries,
        "meta": meta,
    }
    atomic.write_json(directory / MANIFEST, manifest)
    return manifest


def load(
    directory: Path,
    examples_digest: str | None = None,
    *,
    mmap: bool = True,
    digest_key: str = "examples_digest",
) -> tuple[dict[str, np.ndarray], dict]:
    """Verify and load prepared examples (memory-mapped by default)."""
    manifest_path = directory / MANIFEST
    what = digest_key.replace("_", " ")
    if not manifest_path.is_file():
        raise ExamplesError(f"{manifest_path}: missing ({what.rsplit(' ', 1)[0]} not prepared)")
    manifest = atomic.read_json(manifest_path)
    if examples_digest is not None and manifest.get(digest_key) != examples_digest:
        raise ExamplesError(
            f"{manifest_path}: {what} {manifest.get(digest_key)} differs from the "
            f"recipe's {examples_digest}"
        )

    def verified(entry: dict) -> bool:
        file = directory / entry["file"]
        return file.is_file() and sha256_file(file) == entry["sha256"]

    arrays = {}
    # the files hashed side by side (hashlib releases the GIL), checked in the manifest's order
    pool = ThreadPoolExecutor(max(1, min(len(os.sched_getaffinity(0)), 8)))
    try:
        checks = pool.map(verified, manifest["arrays"])
        for entry, ok in zip(manifest["arrays"], checks, strict=True):
            file = directory / entry["file"]
            if not ok:
                raise ExamplesError(f"{file}: missing or sha256 differs from {manifest_path}")
            mode = "r" if mmap else None
            arrays[entry["name"]] = np.load(file, mmap_mode=mode, allow_pickle=False)
    finally:
        pool.shutdown(cancel_futures=True)  # a failed check hashes no further file
    return arrays, manifest
