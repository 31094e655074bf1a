"""The grpo demo's prompts, derived from the Llama demo's mirror task.

``minifield make-demo-data DIR --grpo`` reads the shipped fine-tuning task
``DIR/llama-sft-demo/{split}.jsonl`` (``mirror: s`` → ``s`` followed by ``s`` reversed) and
writes ``DIR/grpo-demo/{split}.jsonl``: the first :data:`PROMPTS` rows of each split as
``{"prompt": "mirror: s", "answer": "s…"}``. The answer is a column the ``exact_match`` reward
checks, never shown to the policy: it learns from the reward alone. DEV and TEST keep the SFT
demo's DEV and TEST prompts, so before and after are measured on the same strings.
"""

from __future__ import annotations

from pathlib import Path

from ..lm import demo_files

#: prompts per split (the first rows of the SFT demo's split of the same name)
PROMPTS = {"train": 1000, "dev": 100, "test": 100}
TARGET_DIR = "grpo-demo"


def write(data_root: Path) -> dict[str, str]:
    """Write ``data_root/grpo-demo/{split}.jsonl`` from ``data_root/llama-sft-demo``; returns
    each written path (relative to ``data_root``) → sha256, for the recipe's pins."""
    files = {}
    for split, count in PROMPTS.items():
        rows = demo_files.mirror_rows(data_root, split, count)
        answers = [{"prompt": row["prompt"], "answer": row["response"]} for row in rows]
        files[f"{TARGET_DIR}/{split}.jsonl"] = demo_files.jsonl(answers)
    return demo_files.write(data_root, files)
