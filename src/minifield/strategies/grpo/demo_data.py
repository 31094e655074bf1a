"""The grpo demo's prompts, derived from the Llama demo's mirror task.

``minifield make-demo-data DIR --grpo`` reads the shipped fine-tuning task
``DIR/llama-sft-demo/{split}.jsonl`` (``mirror: s`` → ``s`` followed by ``s`` reversed) and
writes ``DIR/grpo-demo/{split}.jsonl``: the first :data:`PROMPTS` rows of each split as
``{"prompt": "mirror: s", "answer": "s…"}``. The answer is a column the ``exact_match`` reward
checks, never shown to the policy: it learns from the reward alone. DEV and TEST keep the SFT
demo's DEV and TEST prompts, so before and after are measured on the same strings.
"""

from __future__ import annotations

import json
from pathlib import Path

from ...atomic import write_bytes
from ...digest import sha256_bytes
from ...inputs.pinned import InputError

#: prompts per split (the first rows of the SFT demo's split of the same name)
PROMPTS = {"train": 1000, "dev": 100, "test": 100}
SOURCE_DIR, TARGET_DIR = "llama-sft-demo", "grpo-demo"


def write(data_root: Path) -> dict[str, str]:
    """Write ``data_root/grpo-demo/{split}.jsonl`` from ``data_root/llama-sft-demo``; returns
    each written path (relative to ``data_root``) → sha256, for the recipe's pins."""
    pins = {}
    for split, count in PROMPTS.items():
        source = Path(data_root) / SOURCE_DIR / f"{split}.jsonl"
        try:
            lines = source.read_text(encoding="utf-8").splitlines()
            rows = [json.loads(line) for line in lines if line.strip()]
        except (OSError, ValueError) as exc:
            raise InputError(f"{source}: cannot read the mirror task ({exc})") from None
        if len(rows) < count or any("response" not in row for row in rows[:count]):
            raise InputError(f"{source}: needs {count} rows with a prompt and a response")
        data = "".join(
            json.dumps({"prompt": row["prompt"], "answer": row["response"]}) + "\n"
            for row in rows[:count]
        ).encode("utf-8")
        relative = f"{TARGET_DIR}/{split}.jsonl"
        (Path(data_root) / TARGET_DIR).mkdir(parents=True, exist_ok=True)
        write_bytes(Path(data_root) / relative, data)
        pins[relative] = sha256_bytes(data)
    return pins
