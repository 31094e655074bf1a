"""The checks and the data spec the language-model strategies share, in one order.

packed-sft, preference and grpo (two-stage through packed-sft's) check a recipe by
:func:`check`: what differs is their own section and inputs, and what they check once the
model's values are known. preference and grpo, which prepare from a pinned base, share the
data spec's part :func:`base_spec`.
"""

from __future__ import annotations

from collections.abc import Callable

from ...models import execution
from ...training import lora
from ..base import pinned_inputs
from . import model_section

Check = Callable[[dict], list[dict]]


def check(
    recipe: dict,
    own: Check,
    after: Check | None = None,
    lora_on_mesh=False,
    needs: tuple[str, str] | None = None,
) -> list[dict]:
    """Every check of a language-model recipe, each one spelling where it has one: the model
    section, the strategy's own section and inputs (``own``), the export's dtype and shards,
    LoRA (``lora_on_mesh``: whether the strategy runs it with ``data_parallel.devices`` > 1),
    how the model computes, the model's values, the strategy's checks that read those
    (``after``), and the warmup against ``limits.max_steps``. ``needs``: (the recipe section
    the strategy cannot go without, why); the only error when it is absent, since the other
    checks read it."""
    if needs is not None and needs[0] not in recipe:
        return [{"path": f"/{needs[0]}", "message": needs[1]}]
    errors = model_section.normalize_model_section(recipe["model"])
    errors += own(recipe)
    errors += model_section.normalize_export_dtype(recipe)
    errors += model_section.normalize_export_shards(recipe)
    errors += lora.normalize_section(recipe, data_parallel=lora_on_mesh)
    errors += execution.normalize_recipe(recipe)
    errors += model_section.model_errors(recipe["model"])
    if after is not None:
        errors += after(recipe)
    errors += model_section.warmup_errors(recipe)
    return errors


def base_spec(strategy: str, prepare_version, recipe: dict) -> dict:
    """What a strategy's examples prepared from a pinned base depend on, whatever the
    strategy adds: its inputs, the base and its chat template, the dtype and ``seq_len``."""
    model, training = recipe["model"], recipe["training"]
    return {
        "strategy": strategy,
        "prepare_version": prepare_version,
        "inputs": {i["name"]: i["sha256"] for i in pinned_inputs(recipe)},
        "base": model["base"],
        "chat_template": model.get("chat_template"),
        "compute_dtype": model["compute_dtype"],
        "seq_len": training["seq_len"],
    }
