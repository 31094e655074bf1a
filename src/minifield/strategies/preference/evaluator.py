"""DEV/TEST evaluation of a preference policy, in training and from an export (the gate).

Per split (``{split}_`` prefixed): ``pairs`` (pairs packed), ``preference_accuracy`` (the
share whose chosen answer the policy gives the larger summed log-probability),
``chosen_logps`` and ``rejected_logps`` (their means), and, where the loss can be computed,
``loss`` (the recipe's, mean over pairs), ``reward_accuracy`` and ``reward_margin`` (of the
loss's implicit rewards: for DPO/IPO policy minus reference). An export carries no reference
log-probabilities, so the gate re-evaluates DEV preference accuracy (and, for SimPO/ORPO,
the loss and rewards), from the export's weights and its copy of the DEV pairs.
"""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np

from . import logprobs, losses, pairs
from .pairs import REF_FIELDS


def reference_by_pair(arrays: dict, split: str, n_pairs: int) -> dict[str, np.ndarray] | None:
    """``{ref_chosen, ref_rejected}`` per pair of the file from the rows' slots (None when the
    prepared split has none)."""
    if f"{split}_ref_chosen" not in arrays:
        return None
    index = np.asarray(arrays[f"{split}_pair_index"])
    held = index >= 0
    out = {}
    for key in REF_FIELDS:
        values = np.full(n_pairs, np.nan, np.float32)
        values[index[held]] = np.asarray(arrays[f"{split}_{key}"])[held]
        out[key] = values
    return out


@functools.cache
def _compiled_logps():
    """One jitted :func:`.logprobs.answer_logps` for every evaluator, the model config a
    static argument: evaluators of the same model (the programs of two recipes that differ
    in training settings only, the gate after training) share its compiled programs instead
    of each compiling its own closure."""
    import jax

    return jax.jit(logprobs.answer_logps, static_argnums=1)


class PairEvaluator:
    """The per-pair log-probabilities of a split's packed rows under given parameters, and
    the metrics of the module docstring."""

    def __init__(self, cfg, batch_size: int, settings: losses.LossSettings):
        self.batch_size, self.settings = batch_size, settings
        compiled = _compiled_logps()
        self._logps = lambda params, batch: compiled(params, cfg, batch)
        self._rows_sharding = None  # set by on_mesh: the rows split over the data axis

    def on_mesh(self, rows_sharding, devices: int) -> None:
        """Evaluate on the data-parallel mesh: the parameters stay in the state's shardings
        and each batch of rows is split over the devices like a training batch, padded up
        to a multiple of ``devices`` with empty rows (no pair: nothing is read from them)."""
        self._rows_sharding = rows_sharding
        self.batch_size = -(-self.batch_size // devices) * devices

    def _on_device(self, batch: pairs.PairRows):
        if self._rows_sharding is None:
            return batch
        import jax

        return jax.device_put(batch, self._rows_sharding)

    def metrics(self, params, rows: pairs.PairRows, n_pairs: int, reference=None, prefix="dev"):
        values = logprobs.by_pair(
            lambda batch: self._logps(params, self._on_device(batch)),
            rows,
            self.batch_size,
            n_pairs,
        )
        held = ~np.isnan(values["chosen"])
        picked = {k: v[held] for k, v in values.items()}
        out = {
            f"{prefix}_pairs": float(held.sum()),
            f"{prefix}_preference_accuracy": float(np.mean(picked["chosen"] > picked["rejected"])),
            f"{prefix}_chosen_logps": float(np.mean(picked["chosen"])),
            f"{prefix}_rejected_logps": float(np.mean(picked["rejected"])),
        }
        if self.settings.uses_reference:
            if reference is None:
                return out  # an export: no reference, so neither loss nor rewards
            picked.update({k: v[held] for k, v in reference.items()})
        loss, batch = losses.batch_loss(self.settings, picked, np.ones(int(held.sum())))
        out[f"{prefix}_loss"] = float(loss)
        out[f"{prefix}_reward_accuracy"] = float(batch["reward_accuracy"])
        out[f"{prefix}_reward_margin"] = float(batch["margin"])
        return out

    def split_metrics(self, params, arrays: dict, split: str) -> dict[str, float]:
        n_pairs = int(arrays[f"{split}_pairs"])
        return self.metrics(
            params,
            pairs.PairRows.of(arrays, split),
            n_pairs,
            reference_by_pair(arrays, split, n_pairs),
            split,
        )


def export_metrics(recipe: dict, export_dir: Path) -> dict[str, float]:
    """DEV metrics from the export alone: its weights, tokenizer, chat template and its copy of
    the DEV pairs, which must be the file the recipe pins as ``dev``."""
    from ..lm import export_format

    model = export_format.ExportedModel(Path(export_dir))
    pinned = {i["name"]: i["sha256"] for i in recipe.get("inputs", [])}.get("dev")
    dev = model.dev_file(pinned)
    encoded = pairs.encode(pairs.read(dev), model.tokenizer, model.template)
    training = recipe["training"]
    packed = pairs.pack(encoded, training["seq_len"], training["overlong"], model.tokenizer.pad_id)
    evaluator = PairEvaluator(
        model.cfg, recipe["evaluation"]["batch_size"], losses.LossSettings.of(recipe["preference"])
    )
    return evaluator.metrics(model.params, packed.rows, len(encoded))
