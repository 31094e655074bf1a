"""The input root of a linked computation: its data at their paths, an upstream product's
files in one subdirectory.

A computation made concrete by a pipeline link (a chain's downstream recipe, a two-stage
computation's stage 2) reads inputs from two places: the configured input root (its own
data, as written) and an upstream product (another computation's export). The worker
resolves every input under one root, so the link gives it its own (as remote inputs get
one): each local input hard-linked (or copied across filesystems) at its path, the inputs
whose path lies under ``product_subdir/`` taken from ``product_dir`` by file name.
"""

from __future__ import annotations

from pathlib import Path

from .fetch import place
from .pinned import InputError


class LinkError(InputError):
    """An upstream product a downstream computation cannot be linked to (missing, another
    computation's, tampered, failed its acceptance)."""


def make(
    recipe: dict, input_root: Path, product_dir: Path, product_subdir: str, out_root: Path
) -> None:
    """Fill ``out_root`` for ``recipe`` (every input needs a local ``path``)."""
    for item in recipe.get("inputs", []):
        path = item.get("path")
        if path is None:
            raise LinkError(f"input {item['name']!r}: a linked computation needs local inputs")
        if Path(path).parent == Path(product_subdir):
            place(Path(product_dir) / Path(path).name, Path(out_root) / path)
        else:
            place(Path(input_root) / path, Path(out_root) / path)
