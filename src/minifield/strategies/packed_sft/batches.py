"""The packed rows each update trains on: a pure function of (seed, update).

The row order of epoch ``e`` is a fixed permutation drawn from ``(seed, e)``, so a resumed run
needs no iterator replay and sees exactly the rows the uninterrupted run saw.
"""

from __future__ import annotations

import numpy as np

from .packing import ROW_FIELDS


def epoch_order(seed: int, epoch: int, n_rows: int) -> np.ndarray:
    """Row permutation of one epoch: a pure function of (seed, epoch)."""
    return np.random.Generator(np.random.PCG64([seed, epoch])).permutation(n_rows)


def rows_for_step(seed: int, step: int, batch_size: int, n_rows: int) -> np.ndarray:
    """Indices of the packed rows update ``step`` (0-based) trains on."""
    start = step * batch_size
    out = np.empty(batch_size, dtype=np.int64)
    for j in range(batch_size):
        epoch, within = divmod(start + j, n_rows)
        out[j] = epoch_order(seed, epoch, n_rows)[within]
    return out


class TrainBatches:
    """The training split's batches (the prepared ``train_*`` arrays)."""

    def __init__(self, arrays: dict[str, np.ndarray], seed: int, batch_size: int):
        self.arrays, self.seed, self.batch_size = arrays, seed, batch_size
        self.n_rows = int(arrays["train_tokens"].shape[0])

    def batch(self, step: int) -> dict[str, np.ndarray]:
        """The rows of update ``step`` (0-based), in row order."""
        index = np.sort(rows_for_step(self.seed, step, self.batch_size, self.n_rows))
        return {k: np.asarray(self.arrays[f"train_{k}"][index]) for k in ROW_FIELDS}

    def with_counts(self, step: int) -> tuple[dict[str, np.ndarray], dict[str, int]]:
        """The batch and what it consumes: examples (segments that start in it) and tokens
        (every non-padding slot; the step's own ``tokens`` counts trained targets)."""
        batch = self.batch(step)
        counts = {
            "examples": int(np.count_nonzero((batch["positions"] == 0) & (batch["segments"] > 0))),
            "tokens": int(np.count_nonzero(batch["segments"])),
        }
        return batch, counts
