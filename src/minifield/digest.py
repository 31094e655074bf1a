"""Content digests: canonical JSON and sha256 of bytes, files and JSON documents.

Every address in minifield (computation digest, examples digest, content id)
is a sha256 over *canonical* JSON, so that key order or whitespace never
changes an identity.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

_CHUNK = 1 << 20


def canonical_json(value: Any) -> str:
    """Sorted keys, fixed separators, no NaN: the one serialization digests use."""
    return json.dumps(
        value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
    )


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_json(value: Any) -> str:
    return sha256_bytes(canonical_json(value).encode("utf-8"))


def sha256_file(path: str | Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def short(digest: str) -> str:
    """The 16-hex-character form used in paths; the full digest lives in the files."""
    return digest[:16]
