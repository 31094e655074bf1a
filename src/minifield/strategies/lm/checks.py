"""The checks and the data spec the language-model strategies share, in one order.

packed-sft, preference and grpo (two-stage through packed-sft's) are :class:`LMStrategy`:
its :meth:`~LMStrategy.check` is their one check chain, and what differs between them is
declared (the section a recipe cannot go without, whether LoRA runs on a mesh) or written
as their own checks (:meth:`~LMStrategy.own_checks`, :meth:`~LMStrategy.checks_after`).
preference and grpo, which prepare from a pinned base, share the data spec's part
:func:`base_spec`.
"""

from __future__ import annotations

from abc import abstractmethod

from ...models import execution
from ...training import lora
from ..base import Strategy, pinned_inputs
from . import model_section


class LMStrategy(Strategy):
    """A language-model strategy: a recipe is checked by :meth:`check`, one chain for all."""

    #: why a recipe without one of the strategy's own sections (``extra_sections``) is
    #: refused; that is then the only error, since the other checks read the section
    missing_section_message: str = ""
    #: whether the strategy runs LoRA with ``training.data_parallel.devices`` > 1 (else
    #: :func:`minifield.training.lora.normalize_section` refuses it)
    lora_on_mesh: bool = False

    def check(self, recipe: dict) -> list[dict]:
        """Every check of a language-model recipe, each one spelling where it has one: the
        model section, the strategy's own section and inputs (:meth:`own_checks`), the
        export's dtype and shards, LoRA, how the model computes, the model's values, the
        strategy's checks that read those (:meth:`checks_after`), and the warmup against
        ``limits.max_steps``."""
        missing = [key for key in self.extra_sections if key not in recipe]
        if missing:
            return [{"path": f"/{key}", "message": self.missing_section_message} for key in missing]
        errors = model_section.normalize_model_section(recipe["model"])
        errors += self.own_checks(recipe)
        errors += model_section.normalize_export_dtype(recipe)
        errors += model_section.normalize_export_shards(recipe)
        errors += lora.normalize_section(recipe, data_parallel=self.lora_on_mesh)
        # the step's memory is estimated for the Llama family's parameters (device_memory)
        estimated = self.estimates_step_memory and recipe["model"].get("architecture") == "llama"
        errors += execution.normalize_recipe(recipe, estimated)
        errors += model_section.model_errors(recipe["model"])
        errors += self.checks_after(recipe)
        errors += model_section.warmup_errors(recipe)
        return errors

    @abstractmethod
    def own_checks(self, recipe: dict) -> list[dict]:
        """The strategy's own section and inputs, checked once the model section is."""

    def checks_after(self, recipe: dict) -> list[dict]:
        """The strategy's checks that read the model's values (none by default)."""
        return []


def base_spec(strategy: Strategy, recipe: dict) -> dict:
    """What a strategy's examples prepared from a pinned base depend on, whatever the
    strategy adds: its inputs, the base and its chat template, the dtype and ``seq_len``."""
    model, training = recipe["model"], recipe["training"]
    return {
        "strategy": strategy.name,
        "prepare_version": strategy.prepare_version,
        "inputs": {i["name"]: i["sha256"] for i in pinned_inputs(recipe)},
        "base": model["base"],
        "chat_template": model.get("chat_template"),
        "compute_dtype": model["compute_dtype"],
        "seq_len": training["seq_len"],
    }
