"""grpo recipes over the demo base (data/llama-base, pretrained on ``reverse: word`` among
other tasks): prompts ``reverse: word`` whose ``answer`` column (the reversed word) the
exact_match reward checks, half of them in the ``messages`` shape."""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

from preference_cases import BASE_DIR, BASE_FILES, sha

from minifield.strategies.packed_sft import demo_data

SIZES = {"train": 24, "dev": 8, "test": 8}


def prompt_rows(words: list[str]) -> list[dict]:
    rows = []
    for n, word in enumerate(words):
        prompt = f"reverse: {word}"
        if n % 2:
            rows.append({"messages": [{"role": "user", "content": prompt}], "answer": word[::-1]})
        else:
            rows.append({"prompt": prompt, "answer": word[::-1]})
    return rows


def make_inputs(root: Path, seed: int = 11) -> Path:
    """Prompt files under ``root/prompts`` and the demo base's files under ``root/base``."""
    (root / "prompts").mkdir(parents=True, exist_ok=True)
    for split, examples in demo_data.demo_examples(seed=seed, sizes=SIZES).items():
        rows = prompt_rows([e.prompt for e in examples])
        text = "".join(json.dumps(r) + "\n" for r in rows)
        (root / "prompts" / f"{split}.jsonl").write_text(text)
    (root / "base").mkdir(exist_ok=True)
    for file in BASE_FILES.values():
        shutil.copyfile(BASE_DIR / file, root / "base" / file)
    return root


def pin(root: Path, name: str, path: str) -> dict:
    return {"name": name, "path": path, "sha256": sha(root / path)}


def recipe(root: Path, rl: dict | None = None, **sections) -> dict:
    """A grpo recipe over ``make_inputs(root)``; ``rl`` and ``sections`` replace or extend."""
    out = {
        "job_id": "grpo-test",
        "product": {"name": "reverser-rl", "version": "0"},
        "strategy": {"name": "grpo", "version": "1.0.0"},
        "inputs": [pin(root, s, f"prompts/{s}.jsonl") for s in SIZES]
        + [pin(root, name, f"base/{file}") for name, file in BASE_FILES.items()],
        "model": {
            "base": {
                "config": "base-config",
                "weights": ["base-weights"],
                "tokenizer": "base-tokenizer",
                "tokenizer_config": "base-tokenizer-config",
            },
            "compute_dtype": "float32",
        },
        "training": {"seq_len": 48, "batch_size": 8, "warmup_steps": 1, "learning_rate": 0.003},
        "limits": {"max_steps": 4},
        "checkpoint": {"every_steps": 2, "keep": 2},
        "evaluation": {"eval_every": 0, "batch_size": 8},
        "rl": {
            "num_generations": 4,
            "max_completion_length": 12,
            "rewards": [{"kind": "exact_match", "column": "answer"}],
            **(rl or {}),
        },
    }
    for name, value in copy.deepcopy(sections).items():
        out[name] = {**out[name], **value} if isinstance(out.get(name), dict) else value
    return out
