"""``preference`` 1.0.0: tuning a pinned base model on preference pairs.

Inputs: ``train``, ``dev``, ``test`` (pair files, :mod:`.pairs`), the base model's files
(``model.base``, exactly packed-sft's) and, for DPO/IPO, the reference log-probabilities
(``preference.reference``, :mod:`.reference`). Prepare renders and packs the pairs
(:mod:`.prepared`) and, for DPO/IPO, places each packed pair's reference log-probabilities
beside it (``{split}_ref_chosen``, ``{split}_ref_rejected``: ``[rows, pairs per row]``).
The program (:mod:`.program`) trains the full model or LoRA adapters with the recipe's loss
(:mod:`.losses`); DEV/TEST evaluation and the store's gate (:mod:`.evaluator`) measure
preference accuracy.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from ...data import unknown_text
from ..base import Program
from ..lm import checks
from ..lm import model_section as sft_settings
from ..lm.checks import LMStrategy
from . import section
from .prepared import PREPARE_VERSION
from .section import SPLITS, WITH_REFERENCE


class Preference(LMStrategy):
    name, version = section.NAME, section.VERSION
    description = (
        "Preference tuning of a pinned base model on pairs {prompt | messages, chosen, "
        "rejected}: DPO (label smoothing), IPO, SimPO, ORPO; both answers of a pair as two "
        "segments of one packed row, log-probabilities summed over answer tokens; full "
        "fine-tuning or LoRA; reference log-probabilities as a pinned product; DEV/TEST "
        "preference and reward accuracy; HF/PEFT export."
    )
    default_max_steps = 200
    default_every_steps = 50
    selection_metric = ("dev_loss", "min")
    extra_sections = ("preference",)
    missing_section_message = "the preference strategy needs it"
    prepare_version = PREPARE_VERSION  # the reference product's digest has it too

    def own_checks(self, recipe: dict) -> list[dict]:
        """The preference section and the inputs it wants."""
        errors = sft_settings.router_loss_errors("preference", recipe["model"])
        errors += section.normalize_preference(recipe)
        wanted = section.wanted_inputs(recipe)
        return errors + sft_settings.exact_inputs_errors("preference", wanted, recipe)

    def checks_after(self, recipe: dict) -> list[dict]:
        """The splits of an update's pairs, and unknown text (never read here)."""
        errors = section.split_errors(recipe["training"])
        unknown_text.normalize(recipe["training"])
        return errors + unknown_text.not_read(recipe["training"], "preference")

    def data_spec(self, recipe: dict) -> dict:
        return {
            **checks.base_spec(self, recipe),
            "overlong": recipe["training"]["overlong"],
            "reference": recipe["preference"].get("reference"),
        }

    def prepare(self, recipe: dict, files: dict[str, Path]) -> tuple[dict[str, np.ndarray], dict]:
        from . import prepared, reference

        arrays, meta = prepared.prepare_pairs(recipe, files)
        arrays["dev_jsonl"] = np.frombuffer(files["dev"].read_bytes(), dtype=np.uint8)
        name = recipe["preference"].get("reference")
        if name is not None:
            counts = {split: int(arrays[f"{split}_pairs"]) for split in SPLITS}
            values = reference.load(files[name], recipe, counts)
            for split in SPLITS:
                index = arrays[f"{split}_pair_index"]
                for side in ("chosen", "rejected"):
                    per_pair = values[f"{split}.{side}"]
                    arrays[f"{split}_ref_{side}"] = np.where(
                        index >= 0, per_pair[np.maximum(index, 0)], 0.0
                    ).astype(np.float32)
        return arrays, meta

    def build(self, recipe: dict, examples: dict[str, np.ndarray]) -> Program:
        from .program import PreferenceProgram

        return PreferenceProgram(recipe, examples)

    def acceptance(self, recipe: dict, metrics: dict[str, Any]) -> dict:
        evaluation = recipe["evaluation"]
        thresholds = {"dev_preference_accuracy": evaluation["min_dev_preference_accuracy"]}
        # the training evaluation has DPO/IPO's reward accuracy; an export's re-evaluation (the
        # gate) cannot (no reference in it) and relies on the declared validation for it
        if recipe["preference"]["loss"] in WITH_REFERENCE and "dev_reward_accuracy" in metrics:
            thresholds["dev_reward_accuracy"] = evaluation.get("min_dev_reward_accuracy", 0.0)
        checks = []
        for name, threshold in thresholds.items():
            value = metrics.get(name)
            passed = value is not None and bool(np.isfinite(value)) and value >= threshold
            checks.append({"name": name, "value": value, "threshold": threshold, "passed": passed})
        return {"passed": all(c["passed"] for c in checks), "checks": checks}

    def evaluate_export(self, recipe: dict, export_dir: Path) -> dict[str, Any]:
        """DEV preference accuracy from the export alone: its weights, tokenizer, chat
        template and its copy of the DEV pairs, which must be the file the recipe pins."""
        from .evaluator import export_metrics

        return export_metrics(recipe, Path(export_dir))
