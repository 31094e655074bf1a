"""Weighted training mixtures (``training.mixture``) and gradient accumulation's recipe checks.

A mixture lists training inputs with relative weights::

    training:
      mixture:
        - {input: chat, weight: 3}
        - {input: code, weight: 1}

Each source is packed on its own (a row never holds examples of two sources) and the rows of
all sources are stored one source after another (``train_*`` arrays, ``train_source_rows``
holding each source's row count). Which source each row of an update comes from is drawn per
update from ``(seed, step)`` alone (:func:`sources_of_step`), and a source's rows are read in
epochs of their own, each a permutation drawn from ``(seed, source, epoch)``: the rows of
update ``n`` are a pure function of the seed and ``n``, so a resumed run sees exactly the rows
the uninterrupted one saw. How far each source has been read before update ``n`` is the count
of its draws in updates ``0 .. n-1`` (:class:`SourceCounts`, computed once per process and
extended as training goes on: a resume at update ``n`` redraws the blocks before it, no state).

No ``mixture`` means today's single ``train`` input and its data order
(:mod:`.batches`); a one-entry mixture of ``train`` is the same computation and is removed
when the recipe is checked (one spelling per computation). This module does not import JAX.
"""

from __future__ import annotations

import functools
import threading

import numpy as np

from .. import schemas

#: the input a recipe without a mixture trains on
DEFAULT_INPUT = "train"
#: mixes the per-update source draw's seed sequence apart from the epoch permutations'
_DRAW_TAG = 0x6D6978


def entries(training: dict) -> list[dict]:
    """The mixture's entries, or the one ``train`` input a recipe without one trains on."""
    return training.get("mixture") or [{"input": DEFAULT_INPUT, "weight": 1.0}]


def input_names(training: dict) -> list[str]:
    """The training inputs, in mixture order (the source index is the position here)."""
    return [entry["input"] for entry in entries(training)]


def weights(training: dict) -> np.ndarray:
    """The sources' shares of rows (float64, summing to 1)."""
    raw = np.array([float(entry["weight"]) for entry in entries(training)], dtype=np.float64)
    return raw / raw.sum()


def grad_accum_steps(training: dict) -> int:
    """Micro-batches per update (absent: the schema's ``x-absent``, 1)."""
    absent = schemas.load(schemas.TRAINING)["properties"]["grad_accum_steps"]["x-absent"]
    return int(training.get("grad_accum_steps", absent))


def normalize(recipe: dict) -> list[dict]:
    """One spelling per computation for ``mixture`` and ``grad_accum_steps``; returns errors.

    A one-entry mixture of ``train`` is the recipe without a mixture (removed); weights are
    held as floats (``1`` and ``1.0`` are one computation); ``grad_accum_steps: 1`` is removed
    (recipes written before it keep their digest). The micro-batch must divide evenly.
    """
    training = recipe["training"]
    errors = []
    mixture = training.get("mixture")
    if mixture is not None:
        for entry in mixture:
            entry["weight"] = float(entry["weight"])
        if len(mixture) == 1 and mixture[0]["input"] == DEFAULT_INPUT:
            del training["mixture"]
        names = [entry["input"] for entry in mixture]
        for index, name in enumerate(names):
            if name in names[:index]:
                errors.append(
                    {
                        "path": f"/training/mixture/{index}/input",
                        "message": f"input {name!r} is already a source of the mixture",
                    }
                )
    accum = grad_accum_steps(training)
    if accum == 1:
        training.pop("grad_accum_steps", None)
    rows, devices = training["batch_size"], training["data_parallel"]["devices"]
    # accum 1: the batch itself must split over the devices (checked with data_parallel)
    if accum != 1 and (rows % accum or (rows // accum) % devices):
        errors.append(
            {
                "path": "/training/grad_accum_steps",
                "message": f"must divide training.batch_size={rows} into micro-batches whose "
                f"rows split evenly over training.data_parallel.devices={devices} "
                f"(got {accum}: {rows} / {accum} rows per micro-batch)",
            }
        )
    return errors


def steps_per_block(batch_size: int) -> int:
    """Updates whose draws come from one generator (about 65,536 draws a block): creating a
    generator per update would cost more than the draws themselves."""
    return max(1, 2**16 // batch_size)


@functools.lru_cache(maxsize=4)
def _block(seed: int, block: int, batch_size: int, shares: tuple[float, ...]) -> np.ndarray:
    """``[steps_per_block, batch_size]`` source indices of the updates of ``block``."""
    n = steps_per_block(batch_size)
    uniform = np.random.Generator(np.random.PCG64([seed, _DRAW_TAG, block])).random((n, batch_size))
    cumulative = np.cumsum(shares)
    cumulative[-1] = 1.0  # rounding must not leave a draw past the last source
    drawn = np.searchsorted(cumulative, uniform, side="right").astype(np.int64)
    drawn.setflags(write=False)  # shared through the cache
    return drawn


def sources_of_step(seed: int, step: int, batch_size: int, shares: np.ndarray) -> np.ndarray:
    """The source index of each of update ``step``'s rows: a categorical draw with
    probabilities ``shares``, a pure function of ``(seed, step)`` (updates are drawn in
    blocks of :func:`steps_per_block`, block ``b`` from ``PCG64([seed, tag, b])``)."""
    block, within = divmod(step, steps_per_block(batch_size))
    return _block(seed, block, batch_size, tuple(float(x) for x in shares))[within]


def source_epoch_order(seed: int, source: int, epoch: int, n_rows: int) -> np.ndarray:
    """Row permutation (within the source) of one epoch of ``source``."""
    return np.random.Generator(np.random.PCG64([seed, source + 1, epoch])).permutation(n_rows)


class SourceCounts:
    """Rows drawn from each source before update ``step``: the sum of the draws of updates
    ``0 .. step-1``, extended on demand and kept (thread-safe: the prefetch thread asks too)."""

    def __init__(self, seed: int, batch_size: int, shares: np.ndarray):
        self.seed, self.batch_size, self.shares = seed, batch_size, shares
        self._before = [np.zeros(len(shares), dtype=np.int64)]  # [n]: before update n
        self._lock = threading.Lock()

    def before(self, step: int) -> np.ndarray:
        with self._lock:
            while len(self._before) <= step:
                self._extend()
            return self._before[step].copy()

    def _extend(self) -> None:
        """Append the counts before each update of the next block of draws."""
        n = len(self._before) - 1  # updates counted so far: a whole number of blocks
        per_block = steps_per_block(self.batch_size)
        block = n // per_block
        drawn = _block(self.seed, block, self.batch_size, tuple(float(x) for x in self.shares))
        counts = np.stack([(drawn == s).sum(axis=1) for s in range(len(self.shares))], axis=1)
        running = self._before[-1] + np.cumsum(counts, axis=0)
        self._before.extend(running)
