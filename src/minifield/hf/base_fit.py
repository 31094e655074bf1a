"""What a pinned base's ``config.json`` alone refuses for a recipe, before any tensor is read:
a quantization the base cannot take (:func:`.stored_base.config_quantization_problem`) and,
for packed-sft's step, a device too small for it
(:func:`minifield.models.device_memory.problem`).

Validation never reads inputs (a recipe names its files, not their contents), so this is as
early as the shapes are known: prepare calls it before the conversations are encoded and
before the weights are read (:func:`.pinned_base.check_config`). A ``config.json`` this cannot
read is left to the loader, which names the problem in its own words.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..models import device_memory
from . import stored_base
from .config import CheckpointError, config_from_hf


def problem(recipe: dict, config_path: Path, step_memory: bool) -> str | None:
    """The one line naming what the base refuses (None: nothing); ``step_memory``: also the
    step's estimated memory against ``runtime.device_memory_bytes`` (packed-sft's step)."""
    model = recipe["model"]
    try:
        config = json.loads(Path(config_path).read_text(encoding="utf-8"))
        cfg = config_from_hf(
            config, str(config_path), recipe["training"]["seq_len"], model["compute_dtype"]
        )
    except (OSError, ValueError, TypeError, CheckpointError):
        return None  # the loader reports it, as it always has
    if "lora" in model and not cfg.fused_projections:  # Phi-3's LoRA: refused by the loader
        found = stored_base.config_quantization_problem(model["lora"], cfg, config)
        if found:
            return found
    if step_memory:
        return device_memory.problem(cfg, recipe)
    return None
