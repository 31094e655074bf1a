"""The grpo demo's prompts, derived from the Llama demo's mirror task.

``minifield make-demo-data DIR --grpo`` reads the shipped fine-tuning task
``DIR/llama-sft-demo/{split}.jsonl`` (``mirror: s`` → ``s`` followed by ``s`` reversed) and
writes ``DIR/grpo-demo/{split}.jsonl``: the first :data:`PROMPTS` rows of each split as
``{"prompt": "mirror: s", "answer": "s…"}``. The answer is a column the ``exact_match`` reward
checks, never shown to the policy: it learns from the reward alone. DEV and TEST keep the SFT
demo's DEV and TEST prompts, so before and after are measured on the same strings.

It also writes ``DIR/grpo-learn/{split}.jsonl``, the prompts of the demo where RL is seen to
learn (docs/grpo-demo.md "From a weak start"): in the same form, every row of the SFT demo's
split whose string has :data:`LEARN_LENGTHS` letters. On those lengths the weak SFT stage that
demo starts from samples a right answer now and then; on the others almost never, so their
groups' rewards would not vary and GRPO would have nothing to learn from.
"""

from __future__ import annotations

from pathlib import Path

from ..lm import demo_files

#: prompts per split (the first rows of the SFT demo's split of the same name)
PROMPTS = {"train": 1000, "dev": 100, "test": 100}
TARGET_DIR = "grpo-demo"
#: the weak-start demo's prompts: every row (of the SFT demo's split, whole: :data:`SPLIT_ROWS`
#: rows) whose string has this many letters (inclusive)
LEARN_DIR, LEARN_LENGTHS = "grpo-learn", (4, 6)
SPLIT_ROWS = {"train": 2000, "dev": 200, "test": 200}


def write(data_root: Path) -> dict[str, str]:
    """Write ``data_root/grpo-demo/{split}.jsonl`` and ``data_root/grpo-learn/{split}.jsonl``
    from ``data_root/llama-sft-demo``; returns each written path (relative to ``data_root``) →
    sha256, for the recipes' pins."""
    low, high = LEARN_LENGTHS
    files = {}
    for split, count in PROMPTS.items():
        rows = demo_files.mirror_rows(data_root, split, SPLIT_ROWS[split])
        answers = [{"prompt": row["prompt"], "answer": row["response"]} for row in rows]
        files[f"{TARGET_DIR}/{split}.jsonl"] = demo_files.jsonl(answers[:count])
        learns = [a for a in answers if low <= len(a["prompt"].partition(": ")[2]) <= high]
        files[f"{LEARN_DIR}/{split}.jsonl"] = demo_files.jsonl(learns)
    return demo_files.write(data_root, files)
