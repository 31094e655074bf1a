"""The preference program: packed-sft's program (model, optimizer, LoRA, state, placement,
compiled update, checkpoints, export) with the preference objective, pair batches and pair
evaluation in place of the supervised ones.

The update is :func:`minifield.training.train_step.make_train_step` (or LoRA's) differentiating
:func:`objective`: one forward over the update's packed rows, each answer's log-probabilities
summed (:mod:`.logprobs`), the recipe's loss over the pairs (:mod:`.losses`). Its metrics:
``loss``, ``reward_accuracy``, ``margin`` (the mean reward margin), ``chosen_logps``,
``rejected_logps``, ``pairs`` and ``grad_norm``.
"""

from __future__ import annotations

import numpy as np

from ...training import lora
from ..lm.program import LMProgram
from . import logprobs, losses, section
from .batches import PairBatches
from .evaluator import REF_FIELDS, PairEvaluator


def make_objective(loss_settings: losses.LossSettings):
    """``objective(params, cfg, batch) -> (loss, aux)`` of the preference loss; ``aux`` holds
    ``loss_sum`` and ``tokens`` (answer tokens of the pairs) as the update expects, and the
    batch metrics of :func:`.losses.batch_loss`."""

    def objective(params, cfg, batch):
        logps = logprobs.answer_logps(params, cfg, batch)
        if loss_settings.uses_reference:
            logps.update({key: batch[key] for key in REF_FIELDS})
        loss, metrics = losses.batch_loss(loss_settings, logps, logps["valid"])
        tokens = (logps["chosen_len"] + logps["rejected_len"]) * logps["valid"]
        return loss, {**metrics, "tokens": tokens.sum()}

    return objective


class PreferenceProgram(LMProgram):
    export_strategy = {"name": section.NAME, "version": section.VERSION}

    def __init__(self, recipe: dict, arrays: dict[str, np.ndarray]):
        from ...training import optimizer, train_step

        super().__init__(recipe, arrays)
        training, max_steps = recipe["training"], recipe["limits"]["max_steps"]
        self.loss_settings = losses.LossSettings.of(recipe["preference"])
        self.batches = PairBatches(arrays, training, max_steps, self.tokenizer.pad_id)
        self.examples_per_step = training["batch_size"]
        self.tokens_per_step = self.batches.rows * training["seq_len"]
        objective = make_objective(self.loss_settings)
        schedule = optimizer.make_schedule(training, max_steps)
        if self.lora is None:
            self._step_fn = train_step.make_train_step(
                self.cfg, self.optimizer, schedule, objective
            )
        else:
            self._step_fn = lora.make_train_step(
                self.cfg, self.lora, self.optimizer, schedule, objective=objective
            )
        self.evaluator = PairEvaluator(
            self.cfg, recipe["evaluation"]["batch_size"], self.loss_settings
        )
