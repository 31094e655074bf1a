"""The one writer of the demos' data files (``minifield make-demo-data``), and the Llama
demo's mirror task as the rows the preference and grpo demos derive theirs from."""

from __future__ import annotations

import json
from pathlib import Path

from ...atomic import write_bytes
from ...digest import sha256_bytes
from ...inputs.pinned import InputError

#: the Llama demo's fine-tuning task, under the data root
MIRROR_DIR = "llama-sft-demo"


def jsonl(rows: list[dict]) -> bytes:
    """One JSON object a line, as every demo file holds its rows."""
    return "".join(json.dumps(row) + "\n" for row in rows).encode("utf-8")


def write(root: Path, files: dict[str, bytes]) -> dict[str, str]:
    """Each file written whole under ``root`` (its directories made); returns each name
    (relative to ``root``) → sha256, for the recipes' pins."""
    pins = {}
    for relative, data in files.items():
        path = Path(root) / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        write_bytes(path, data)
        pins[relative] = sha256_bytes(data)
    return pins


def mirror_rows(data_root: Path, split: str, count: int) -> list[dict]:
    """The first ``count`` rows of the mirror task's ``split`` (``{"prompt", "response"}``);
    a file that cannot be read or has fewer such rows ends the command (one line)."""
    source = Path(data_root) / MIRROR_DIR / f"{split}.jsonl"
    try:
        lines = source.read_text(encoding="utf-8").splitlines()
        rows = [json.loads(line) for line in lines if line.strip()]
    except (OSError, ValueError) as exc:
        raise InputError(f"{source}: cannot read the mirror task ({exc})") from None
    if len(rows) < count or any("response" not in row for row in rows[:count]):
        raise InputError(f"{source}: needs {count} rows with a prompt and a response")
    return rows[:count]
