"""The packed rows each update trains on: a pure function of (seed, update).

The row order of epoch ``e`` is a fixed permutation drawn from ``(seed, e)``, so a resumed run
needs no iterator replay and sees exactly the rows the uninterrupted run saw. A weighted
mixture of sources (:mod:`.mixture`) draws each row's source from ``(seed, step)`` and reads
each source in epochs of its own (:class:`MixtureBatches`).
"""

from __future__ import annotations

import threading

import numpy as np

from . import mixture
from .packing import Rows


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

    def batch(self, step: int) -> Rows:
        """The rows of update ``step`` (0-based), in row order."""
        index = np.sort(rows_for_step(self.seed, step, self.batch_size, self.n_rows))
        return Rows.of(self.arrays, "train").take(index)

    def with_counts(self, step: int) -> tuple[Rows, dict[str, int]]:
        """The batch and what it consumes: examples (segments that start in it) and tokens
        (every non-padding slot; the step's own ``tokens`` counts trained targets)."""
        batch = self.batch(step)
        return batch, consumed(batch)


def consumed(batch: Rows) -> dict[str, int]:
    """Examples (segments that start in the rows) and tokens (non-padding slots) of rows."""
    return {
        "examples": int(np.count_nonzero((batch.positions == 0) & (batch.segments > 0))),
        "tokens": int(np.count_nonzero(batch.segments)),
    }


class MixtureBatches:
    """The batches of a weighted mixture: the prepared rows of every source, one source after
    another (``train_source_rows`` holds each source's row count, in mixture order)."""

    def __init__(self, arrays: dict[str, np.ndarray], training: dict):
        self.arrays, self.seed = arrays, training["seed"]
        self.batch_size = training["batch_size"]
        self.names = mixture.input_names(training)
        self.n_rows = np.asarray(arrays["train_source_rows"], dtype=np.int64)
        if len(self.n_rows) != len(self.names):
            raise ValueError(
                f"the prepared examples hold {len(self.n_rows)} sources, the recipe's "
                f"training.mixture {len(self.names)}"
            )
        self.offsets = np.concatenate([[0], np.cumsum(self.n_rows)[:-1]])
        self._orders: dict[tuple[int, int], np.ndarray] = {}  # (source, epoch) → rows
        self._orders_lock = threading.Lock()  # the prefetch thread builds batches too
        self.shares = mixture.weights(training)
        self.drawn = mixture.SourceCounts(self.seed, self.batch_size, self.shares)

    def rows_and_sources(self, step: int) -> tuple[np.ndarray, np.ndarray]:
        """Update ``step``'s row indices (into the stored rows) and each row's source."""
        sources = mixture.sources_of_step(self.seed, step, self.batch_size, self.shares)
        position = self.drawn.before(step)
        rows = np.empty(self.batch_size, dtype=np.int64)
        for j, source in enumerate(sources):
            n = int(self.n_rows[source])
            epoch, within = divmod(int(position[source]), n)
            order = self._order(int(source), epoch)
            rows[j] = self.offsets[source] + order[within]
            position[source] += 1
        return rows, sources

    def _order(self, source: int, epoch: int) -> np.ndarray:
        """Epoch ``epoch``'s permutation of ``source``; kept while it is read (two epochs of
        a source at most: the one ending and the one starting)."""
        with self._orders_lock:
            order = self._orders.get((source, epoch))
            if order is None:
                n = int(self.n_rows[source])
                order = mixture.source_epoch_order(self.seed, source, epoch, n)
                self._orders[(source, epoch)] = order
                for key in [k for k in self._orders if k[0] == source and k[1] < epoch - 1]:
                    del self._orders[key]
            return order

    def batch(self, step: int) -> Rows:
        return self.with_counts(step)[0]

    def with_counts(self, step: int) -> tuple[Rows, dict]:
        """The batch (rows in stored order), what it consumes, and per source (by input
        name): its rows, trained tokens (``loss_tokens``) and the epochs read of it after
        this update."""
        rows, sources = self.rows_and_sources(step)
        order = np.argsort(rows, kind="stable")
        rows, sources = rows[order], sources[order]
        batch = Rows.of(self.arrays, "train").take(rows)
        after = self.drawn.before(step + 1)
        loss_tokens = batch.loss_mask.sum(axis=1)
        per_source = {
            name: {
                "rows": int(np.count_nonzero(sources == s)),
                "loss_tokens": int(loss_tokens[sources == s].sum()),
                "epochs": float(after[s] / self.n_rows[s]),
            }
            for s, name in enumerate(self.names)
        }
        return batch, {**consumed(batch), "sources": per_source}
