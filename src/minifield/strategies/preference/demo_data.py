"""The preference demo's pairs, derived from the Llama demo's mirror task.

``minifield make-demo-data DIR --preference`` reads the shipped fine-tuning task
``DIR/llama-sft-demo/{split}.jsonl`` (``mirror: s`` → ``s`` followed by ``s`` reversed,
:mod:`minifield.strategies.packed_sft.demo_data`) and writes ``DIR/preference-demo/{split}.jsonl``: one pair per
row of the first :data:`PAIRS` rows of each split, ``{"prompt", "chosen", "rejected"}`` (TRL's
string shape). ``chosen`` is the correct answer; ``rejected`` a near miss of it, one edit
away: a letter **changed** (to another letter), **dropped**, or two adjacent different
letters **swapped**. Which edit, where and which letter come from ``random.Random`` seeded
per split (stable across Python versions), so the files regenerate byte for byte; DEV and
TEST pairs keep the prompts of the SFT demo's DEV and TEST, so exact-match before and after
preference tuning is measured on the same strings.
"""

from __future__ import annotations

import random
from pathlib import Path

from ..lm import demo_files

#: pairs per split (the first rows of the SFT demo's split of the same name)
PAIRS = {"train": 300, "dev": 100, "test": 100}
SEED = 20261202
ALPHABET = "abcdefghijklmnopqrstuvwxyz"
EDITS = ("change", "drop", "swap")
TARGET_DIR = "preference-demo"


def near_miss(answer: str, rng: random.Random) -> tuple[str, str]:
    """``(edit, rejected)``: ``answer`` with one letter changed, dropped, or two adjacent
    different letters swapped (a mirror answer always has such a pair: it has two distinct
    letters or is one letter repeated, where a change or drop is drawn instead)."""
    edit = EDITS[rng.randrange(len(EDITS))]
    swappable = [i for i in range(len(answer) - 1) if answer[i] != answer[i + 1]]
    if edit == "swap" and not swappable:
        edit = "change"
    if edit == "swap":
        i = swappable[rng.randrange(len(swappable))]
        return edit, answer[:i] + answer[i + 1] + answer[i] + answer[i + 2 :]
    i = rng.randrange(len(answer))
    if edit == "drop":
        return edit, answer[:i] + answer[i + 1 :]
    others = [c for c in ALPHABET if c != answer[i]]
    return edit, answer[:i] + others[rng.randrange(len(others))] + answer[i + 1 :]


def pairs(rows: list[dict], split: str) -> list[dict]:
    rng = random.Random(f"{SEED}:{split}")
    out = []
    for row in rows[: PAIRS[split]]:
        _, rejected = near_miss(row["response"], rng)
        out.append({"prompt": row["prompt"], "chosen": row["response"], "rejected": rejected})
    return out


def write(data_root: Path) -> dict[str, str]:
    """Write ``data_root/preference-demo/{split}.jsonl`` from ``data_root/llama-sft-demo``;
    returns each written path (relative to ``data_root``) → sha256, for the recipe's pins."""
    files = {
        f"{TARGET_DIR}/{split}.jsonl": demo_files.jsonl(
            pairs(demo_files.mirror_rows(data_root, split, count), split)
        )
        for split, count in PAIRS.items()
    }
    return demo_files.write(data_root, files)
