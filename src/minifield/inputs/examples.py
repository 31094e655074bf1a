"""Prepared examples: arrays (``.npy``, memory-mappable) plus a manifest, addressed by the examples digest.

Recipes with equal data settings share one prepared directory
(``results/examples/{edigest}/``); training verifies the manifest's digest and
every array's sha256 before using them (the files hashed side by side, one thread each).
"""

from __future__ import annotations

import os
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
    directory: Path, arrays: dict[str, np.ndarray], meta: dict[str, Any], examples_digest: str
) -> dict:
    """Write arrays, then the manifest last (its presence means the directory is complete)."""
    directory.mkdir(parents=True, exist_ok=True)
    entries = []
    for name, array in sorted(arrays.items()):
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
        "format": FORMAT,
        "examples_digest": examples_digest,
        "arrays": entries,
        "meta": meta,
    }
    atomic.write_json(directory / MANIFEST, manifest)
    return manifest


def load(
    directory: Path, examples_digest: str | None = None, *, mmap: bool = True
) -> tuple[dict[str, np.ndarray], dict]:
    """Verify and load prepared examples (memory-mapped by default)."""
    manifest_path = directory / MANIFEST
    if not manifest_path.is_file():
        raise ExamplesError(f"{manifest_path}: missing (examples not prepared)")
    manifest = atomic.read_json(manifest_path)
    if examples_digest is not None and manifest.get("examples_digest") != examples_digest:
        raise ExamplesError(
            f"{manifest_path}: examples digest {manifest.get('examples_digest')} differs from the "
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
