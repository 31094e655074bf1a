"""Where things live in a store directory, and which files make up a payload."""

from __future__ import annotations

import re
from pathlib import Path

from .errors import StoreError

FORMAT = "minifield-artifact/1"
POINTER_FORMAT = "minifield-store-pointer/1"
ARTIFACTS = "artifacts"
MANIFEST = "manifest.json"
POINTER = "active.json"
LOCK = ".lock"
PROOF_EVIDENCE = "evidence/proof.json"
#: files a directory() output of Snakemake gains; never part of a payload
EXCLUDED_NAMES = frozenset({".snakemake_timestamp"})
DEFAULT_DIR = "results/store"

_HEX64 = re.compile(r"^[0-9a-f]{64}$")


def is_sha256(value: object) -> bool:
    """True for 64 lower-case hex characters: a content id, a file or state hash."""
    return isinstance(value, str) and bool(_HEX64.match(value))


def payload_files(directory: Path) -> list[str]:
    """Relative posix paths of the regular files under ``directory`` (sorted)."""
    files = []
    for path in sorted(directory.rglob("*")):
        if path.name in EXCLUDED_NAMES:
            continue
        if path.is_symlink():
            raise StoreError(f"{path}: symbolic links are not published (copy the file instead)")
        if path.is_file():
            files.append(path.relative_to(directory).as_posix())
    return files
