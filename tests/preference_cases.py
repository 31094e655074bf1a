"""Preference recipes over the demo base (data/llama-base, pretrained on ``reverse: word``
among other tasks): pairs whose chosen answer is the reversed word and whose rejected answer
is a near miss (its last two letters swapped), half of them in the ``messages`` shape."""

from __future__ import annotations

import copy
import hashlib
import json
import shutil
from pathlib import Path

from conftest import REPO

from minifield.strategies.packed_sft import demo_data

BASE_DIR = REPO / "data" / "llama-base"
BASE_FILES = {
    "base-config": "config.json",
    "base-weights": "model.safetensors",
    "base-tokenizer": "tokenizer.json",
    "base-tokenizer-config": "tokenizer_config.json",
}
SIZES = {"train": 24, "dev": 8, "test": 8}


def sha(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def near_miss(answer: str) -> str:
    """The answer with its last two letters swapped (or one letter added if they are equal)."""
    if answer[-1] == answer[-2]:
        return answer + "a"
    return answer[:-2] + answer[-1] + answer[-2]


def pair_rows(words: list[str], flip: bool = False) -> list[dict]:
    rows = []
    for n, word in enumerate(words):
        prompt = f"reverse: {word}"  # the task as the demo base was trained on it
        good, bad = word[::-1], near_miss(word[::-1])
        chosen, rejected = (bad, good) if flip else (good, bad)
        if n % 2:
            rows.append(
                {
                    "messages": [{"role": "user", "content": prompt}],
                    "chosen": chosen,
                    "rejected": rejected,
                }
            )
        else:
            rows.append({"prompt": prompt, "chosen": chosen, "rejected": rejected})
    return rows


def make_inputs(root: Path, seed: int = 11, flip: bool = False) -> Path:
    """Pair files under ``root/pairs`` (``flip``: chosen and rejected swapped, so the base
    prefers the rejected answers) and the demo base's files under ``root/base``."""
    (root / "pairs").mkdir(parents=True, exist_ok=True)
    for split, examples in demo_data.demo_examples(seed=seed, sizes=SIZES).items():
        rows = pair_rows([e.prompt for e in examples], flip)
        (root / "pairs" / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (root / "base").mkdir(exist_ok=True)
    for file in BASE_FILES.values():
        shutil.copyfile(BASE_DIR / file, root / "base" / file)
    return root


def recipe(root: Path, preference: dict, **sections) -> dict:
    """A preference recipe over ``make_inputs(root)``; ``sections`` replace or extend."""
    out = {
        "job_id": "pref-test",
        "product": {"name": "reverser-pref", "version": "0"},
        "strategy": {"name": "preference", "version": "1.0.0"},
        "inputs": [
            {"name": s, "path": f"pairs/{s}.jsonl", "sha256": sha(root / "pairs" / f"{s}.jsonl")}
            for s in SIZES
        ]
        + [
            {"name": name, "path": f"base/{file}", "sha256": sha(root / "base" / file)}
            for name, file in BASE_FILES.items()
        ],
        "model": {
            "base": {
                "config": "base-config",
                "weights": ["base-weights"],
                "tokenizer": "base-tokenizer",
                "tokenizer_config": "base-tokenizer-config",
            },
            "compute_dtype": "float32",
        },
        "training": {"seq_len": 64, "batch_size": 4, "warmup_steps": 1, "learning_rate": 0.003},
        "limits": {"max_steps": 4},
        "checkpoint": {"every_steps": 2, "keep": 2},
        "evaluation": {"eval_every": 0, "batch_size": 8},
        "preference": dict(preference),
    }
    for name, value in copy.deepcopy(sections).items():
        out[name] = {**out[name], **value} if isinstance(out.get(name), dict) else value
    return out


def with_reference(recipe_: dict, root: Path, reference_path: str, name: str = "reference"):
    """``recipe_`` pinning ``root/reference_path`` as input ``name`` for DPO/IPO."""
    out = copy.deepcopy(recipe_)
    out["inputs"].append(
        {"name": name, "path": reference_path, "sha256": sha(root / reference_path)}
    )
    out["preference"]["reference"] = name
    return out
