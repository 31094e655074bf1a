"""``grpo`` 1.0.0: online reinforcement learning on verifiable rewards of a pinned base model.

Inputs: ``train``, ``dev``, ``test`` (prompt files, :mod:`.prompts`), the base model's files
(``model.base``, exactly packed-sft's) and each Python reward's file. Prepare renders and
tokenizes the prompts and keeps the rows' columns for the rewards. The program
(:mod:`.program`) samples G completions per prompt from the policy, scores them
(:mod:`minifield.rl.rewards`) and updates the full model or LoRA adapters with the GRPO
objective (:mod:`minifield.rl.objective`); DEV/TEST evaluation and the store's gate
(:mod:`.evaluator`) decode greedily and measure the mean reward and pass@1.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from ...rl import rewards as reward_kinds
from ..base import Program
from ..lm import checks, model_section
from ..lm.checks import LMStrategy
from . import section
from .section import SPLITS


class GRPO(LMStrategy):
    name, version = section.NAME, section.VERSION
    description = (
        "Online reinforcement learning on verifiable rewards of a pinned base model: G sampled "
        "completions per prompt from the policy's key/value cache, built-in and pinned Python "
        "rewards, group advantages, GRPO/DAPO/Dr. GRPO/BNPO losses with clipping, GSPO's "
        "sequence ratio and a k3 KL to the reference; full fine-tuning or LoRA; rollouts kept "
        "per update; DEV/TEST greedy mean reward and pass@1; HF/PEFT export."
    )
    default_max_steps = 100
    default_every_steps = 10
    selection_metric = ("dev_reward", "max")
    extra_sections = ("rl",)
    missing_section_message = "the grpo strategy needs it (rl.rewards at least)"
    lora_on_mesh = True

    def own_checks(self, recipe: dict) -> list[dict]:
        """The rl section and the inputs it wants."""
        errors = model_section.router_loss_errors("grpo", recipe["model"])
        errors += section.normalize_rl(recipe)
        wanted = section.wanted_inputs(recipe)
        return errors + model_section.exact_inputs_errors("grpo", wanted, recipe)

    def data_spec(self, recipe: dict) -> dict:
        return {
            **checks.base_spec(self, recipe),
            "max_completion_length": recipe["rl"]["max_completion_length"],
            "columns": reward_kinds.columns_read(recipe["rl"]["rewards"]),
        }

    def prepare(self, recipe: dict, files: dict[str, Path]) -> tuple[dict[str, np.ndarray], dict]:
        from ...hf import pinned_base
        from . import prompts
        from .evaluator import REWARD_FILE_ARRAY

        arrays, base_meta = pinned_base.load(recipe, files, without_router_loss="grpo")
        tokenizer, template = pinned_base.tokenizer_from_arrays(recipe, arrays, files)
        room = recipe["training"]["seq_len"] - recipe["rl"]["max_completion_length"]
        needed = reward_kinds.columns_read(recipe["rl"]["rewards"])
        meta = {"base_model": base_meta, "chat_template": template.source, "splits": {}}
        for split in SPLITS:
            rows = prompts.read(files[split], needed)
            ids = prompts.encode(rows, tokenizer, template, room)
            arrays.update(prompts.to_arrays(rows, ids, tokenizer.pad_id, split))
            lengths = [len(i) for i in ids]
            meta["splits"][split] = {
                "prompts": len(rows),
                "prompt_tokens_max": max(lengths),
                "prompt_tokens_mean": float(np.mean(lengths)),
            }
        arrays["dev_jsonl"] = np.frombuffer(files["dev"].read_bytes(), dtype=np.uint8)
        for name in section.python_reward_inputs(recipe):
            data = files[name].read_bytes()
            arrays[REWARD_FILE_ARRAY.format(name=name)] = np.frombuffer(data, dtype=np.uint8)
        return arrays, meta

    def build(self, recipe: dict, examples: dict[str, np.ndarray]) -> Program:
        from .program import GRPOProgram

        return GRPOProgram(recipe, examples)

    def acceptance(self, recipe: dict, metrics: dict[str, Any]) -> dict:
        threshold = recipe["evaluation"]["min_dev_reward"]
        value = metrics.get("dev_reward")
        passed = value is not None and bool(np.isfinite(value)) and value >= threshold
        check = {"name": "dev_reward", "value": value, "threshold": threshold, "passed": passed}
        return {"passed": passed, "checks": [check]}

    def evaluate_export(self, recipe: dict, export_dir: Path) -> dict[str, Any]:
        """DEV mean reward and pass@1 from the export alone (:mod:`.evaluator`)."""
        from .evaluator import export_metrics

        return export_metrics(recipe, Path(export_dir))
