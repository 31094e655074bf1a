"""The pairs each update trains on: ``training.batch_size`` pairs, a pure function of
(seed, update), packed into a fixed number of rows.

The pair order of epoch ``e`` is a fixed permutation drawn from ``(seed, e)``
(:func:`minifield.data.batches.rows_for_step` over pairs instead of rows), so a resumed run sees
exactly the pairs the uninterrupted run saw. Update ``k``'s pairs are packed on the host
(:func:`.pairs.pack`: both answers of a pair in one row) and padded with empty rows to
:attr:`PairBatches.rows`, the most rows any of the run's updates needs (computed once from
the pairs' lengths), so every update has one shape and compiles once.
"""

from __future__ import annotations

import numpy as np

from ...data.batches import rows_for_step
from ...data.packing import first_fit_decreasing
from . import logprobs, pairs, prepared
from .evaluator import REF_FIELDS, reference_by_pair


class PairBatches:
    """The training split's pairs (prepared ``train_*`` arrays), by update."""

    def __init__(self, arrays: dict, training: dict, max_steps: int, pad_id: int):
        self.seed, self.batch_size = training["seed"], training["batch_size"]
        self.seq_len, self.pad_id = training["seq_len"], pad_id
        held = pairs.unpack(prepared.split_rows(arrays, "train"))
        self.ids = np.asarray(sorted(held), np.int64)  # the pairs packing kept
        self.pairs = [held[i] for i in self.ids]
        n_pairs = int(arrays["train_pairs"])
        self.reference = reference_by_pair(arrays, "train", n_pairs)
        lengths = np.asarray([len(p) for p in self.pairs])
        self.rows = max(
            len(first_fit_decreasing(lengths[self.order(step)].tolist(), self.seq_len))
            for step in range(max_steps)
        )

    def order(self, step: int) -> np.ndarray:
        """Positions (into :attr:`pairs`) of update ``step``'s pairs, in ascending order."""
        return np.sort(rows_for_step(self.seed, step, self.batch_size, len(self.pairs)))

    def batch(self, step: int) -> dict[str, np.ndarray]:
        """Update ``step``'s packed rows (pair slots index the file's pairs) and, with a
        reference, each slot's reference log-probabilities."""
        positions = self.order(step)
        packed = pairs.pack([self.pairs[i] for i in positions], self.seq_len, "reject", self.pad_id)
        rows = logprobs.padded(packed.arrays, self.rows)
        width = rows["pair_index"].shape[1]
        slots = np.full((self.rows, self.batch_size), -1, np.int32)
        slots[:, :width] = rows["pair_index"]  # one width for every update: batch_size
        held = slots >= 0
        rows["pair_index"] = np.where(held, self.ids[positions][np.maximum(slots, 0)], -1)
        rows["pair_index"] = rows["pair_index"].astype(np.int32)
        if self.reference is not None:
            for key in REF_FIELDS:
                values = self.reference[key][np.maximum(rows["pair_index"], 0)]
                rows[key] = np.where(held, values, 0.0).astype(np.float32)
        return rows

    def with_counts(self, step: int) -> tuple[dict[str, np.ndarray], dict[str, int]]:
        """The batch and what it consumes: pairs (``examples``) and non-padding tokens."""
        batch = self.batch(step)
        return batch, {
            "examples": int(np.count_nonzero(batch["pair_index"] >= 0)),
            "tokens": int(np.count_nonzero(batch["segments"])),
        }
