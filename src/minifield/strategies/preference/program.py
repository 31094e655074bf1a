"""The preference program: packed-sft's program (model, optimizer, LoRA, state, placement,
compiled update, checkpoints, export) with the preference objective, pair batches and pair
evaluation in place of the supervised ones.

The update is :func:`minifield.training.train_step.make_train_step` (or LoRA's) differentiating
:func:`objective`: one forward over the update's packed rows, each answer's log-probabilities
summed (:mod:`.logprobs`), the recipe's loss over the pairs (:mod:`.losses`). Its metrics:
``loss``, ``reward_accuracy``, ``margin`` (the mean reward margin), ``chosen_logps``,
``rejected_logps``, ``pairs`` and ``grad_norm``.

Data parallelism and gradient accumulation are packed-sft's (the language-model program's
mesh, :mod:`minifield.training.data_parallel`; :func:`minifield.training.train_step.accumulated_gradient`):
each device and each micro-batch holds ``batch_size / (devices · grad_accum_steps)`` whole
pairs (:mod:`.batches`). Every pair's loss reads that pair's answers only (SimPO's and ORPO's
length normalisation and the RPO term divide by the pair's own answer lengths), so the
update's loss ``(1/P) Σ_i ℓ_i`` over its P pairs has the gradient ``(1/P) Σ_m ∇ Σ_{i∈m} ℓ_i``:
each micro-batch's gradient of its pairs' loss *sum*, summed, divided once by P
(:data:`ACCUMULATION`); the metrics that are means over pairs are combined weighted by each
micro-batch's pairs. On a mesh XLA sums the devices' partial gradients the same way.
"""

from __future__ import annotations

import numpy as np

from ...training.train_step import Accumulation
from ..lm.program import LMProgram
from . import logprobs, losses, section
from .batches import PairBatches
from .evaluator import PairEvaluator


def make_objective(loss_settings: losses.LossSettings):
    """``objective(params, cfg, batch) -> (loss, aux)`` of the preference loss; ``aux`` holds
    ``loss_sum`` and ``tokens`` (answer tokens of the pairs) as the update expects, and the
    batch metrics of :func:`.losses.batch_loss`."""

    def objective(params, cfg, batch):
        logps = logprobs.answer_logps(params, cfg, batch)
        if loss_settings.uses_reference:
            logps.update(ref_chosen=batch.ref_chosen, ref_rejected=batch.ref_rejected)
        loss, metrics = losses.batch_loss(loss_settings, logps, logps["valid"])
        tokens = (logps["chosen_len"] + logps["rejected_len"]) * logps["valid"]
        return loss, {**metrics, "tokens": tokens.sum()}

    return objective


#: the objective's loss is a mean over pairs, as are these metrics of it
ACCUMULATION = Accumulation(
    "pairs", ("reward_accuracy", "margin", "chosen_logps", "rejected_logps")
)


class PreferenceProgram(LMProgram):
    export_strategy = {"name": section.NAME, "version": section.VERSION}
    accumulation = ACCUMULATION
    one_process = "its pairs are packed on that process's host"

    def __init__(self, recipe: dict, arrays: dict[str, np.ndarray]):
        self.loss_settings = losses.LossSettings.of(recipe["preference"])
        super().__init__(recipe, arrays)
        self.tokens_per_step = self.batches.rows * recipe["training"]["seq_len"]

    def objective(self):
        return make_objective(self.loss_settings)

    def make_batches(self, arrays: dict[str, np.ndarray], training: dict) -> PairBatches:
        return PairBatches(
            arrays,
            training,
            self.recipe["limits"]["max_steps"],
            self.tokenizer.pad_id,
            self.data_parallel.devices,
            self.accum_steps,
        )

    def make_evaluator(self) -> PairEvaluator:
        return PairEvaluator(self.cfg, self.recipe["evaluation"]["batch_size"], self.loss_settings)
