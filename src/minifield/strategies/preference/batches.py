"""The pairs each update trains on: ``training.batch_size`` pairs, a pure function of
(seed, update), packed into a fixed number of rows.

The pair order of epoch ``e`` is a fixed permutation drawn from ``(seed, e)``
(:func:`minifield.data.batches.rows_for_step` over pairs instead of rows), so a resumed run sees
exactly the pairs the uninterrupted run saw. Update ``k``'s pairs are packed on the host
(:func:`.pairs.pack`: both answers of a pair in one row) and padded with empty rows to
:attr:`PairBatches.rows`, the most rows any of the run's updates needs (computed once from
the pairs' lengths), so every update has one shape and compiles once.

With data parallelism (``training.data_parallel.devices`` N) or gradient accumulation
(``training.grad_accum_steps`` k), G = N·k > 1: the update's pairs (in ascending order) are
cut into G consecutive groups of ``batch_size / G`` pairs, each group packed on its own into
the same number of rows R (the most any group of the run needs), and the groups' rows laid
out so that device ``d`` holds rows ``[d·k·R, (d+1)·k·R)`` (the batch's row split) and
micro-batch ``m`` rows ``m, m + k, …`` (:func:`minifield.training.train_step.micro_batches`):
group ``d·k + m`` is exactly device ``d``'s share of micro-batch ``m``. Every device and
micro-batch thus holds the same number of whole pairs. G = 1 is the packing above, unchanged.
"""

from __future__ import annotations

import numpy as np

from ...data.batches import rows_for_step
from ...data.packing import first_fit_decreasing
from . import logprobs, pairs
from .evaluator import reference_by_pair
from .pairs import PairRows


class PairBatches:
    """The training split's pairs (prepared ``train_*`` arrays), by update."""

    def __init__(
        self,
        arrays: dict,
        training: dict,
        max_steps: int,
        pad_id: int,
        devices: int = 1,
        accum_steps: int = 1,
    ):
        self.seed, self.batch_size = training["seed"], training["batch_size"]
        self.seq_len, self.pad_id = training["seq_len"], pad_id
        self.devices, self.accum_steps = devices, accum_steps
        self.groups = devices * accum_steps  # validation: it divides batch_size
        held = pairs.unpack(PairRows.of(arrays, "train"))
        self.ids = np.asarray(sorted(held), np.int64)  # the pairs packing kept
        self.pairs = [held[i] for i in self.ids]
        n_pairs = int(arrays["train_pairs"])
        self.reference = reference_by_pair(arrays, "train", n_pairs)
        lengths = np.asarray([len(p) for p in self.pairs])
        #: rows of one group (of the whole update when G = 1)
        self.group_rows = max(
            len(first_fit_decreasing(lengths[group].tolist(), self.seq_len))
            for step in range(max_steps)
            for group in np.split(self.order(step), self.groups)
        )
        self.rows = self.groups * self.group_rows

    def order(self, step: int) -> np.ndarray:
        """Positions (into :attr:`pairs`) of update ``step``'s pairs, in ascending order."""
        return np.sort(rows_for_step(self.seed, step, self.batch_size, len(self.pairs)))

    def packed(self, positions: np.ndarray) -> PairRows:
        """The pairs at ``positions`` packed into :attr:`group_rows` rows (pair slots index the
        file's pairs) and, with a reference, each slot's reference log-probabilities."""
        packed = pairs.pack([self.pairs[i] for i in positions], self.seq_len, "reject", self.pad_id)
        rows = logprobs.padded(packed.rows, self.group_rows)
        width = rows.pair_index.shape[1]
        # one width for every update: a group's pairs
        slots = np.full((self.group_rows, self.batch_size // self.groups), -1, np.int32)
        slots[:, :width] = rows.pair_index
        held = slots >= 0
        index = np.where(held, self.ids[positions][np.maximum(slots, 0)], -1).astype(np.int32)
        rows = rows._replace(pair_index=index)
        if self.reference is not None:  # ref_chosen, ref_rejected: 0 in an empty slot
            slot = np.maximum(index, 0)
            ref = {k: np.where(held, v[slot], 0.0) for k, v in self.reference.items()}
            rows = rows._replace(**{k: v.astype(np.float32) for k, v in ref.items()})
        return rows

    def batch(self, step: int) -> PairRows:
        """Update ``step``'s packed rows: its pairs, each group's where its device and
        micro-batch read them (the module docstring)."""
        positions = self.order(step)
        if self.groups == 1:
            return self.packed(positions)
        parts = [self.packed(group) for group in np.split(positions, self.groups)]
        N, k, R = self.devices, self.accum_steps, self.group_rows

        def laid_out(*values):
            stacked = np.stack(values)  # [G, R, ...], g = d·k + m
            grouped = stacked.reshape(N, k, R, *stacked.shape[2:]).swapaxes(1, 2)
            return np.ascontiguousarray(grouped.reshape(N * R * k, *stacked.shape[2:]))

        return PairRows._make(
            None if field[0] is None else laid_out(*field) for field in zip(*parts, strict=True)
        )

    def with_counts(self, step: int) -> tuple[PairRows, dict[str, int]]:
        """The batch and what it consumes: pairs (``examples``) and non-padding tokens."""
        batch = self.batch(step)
        return batch, {
            "examples": int(np.count_nonzero(batch.pair_index >= 0)),
            "tokens": int(np.count_nonzero(batch.segments)),
        }
