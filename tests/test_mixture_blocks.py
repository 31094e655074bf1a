"""Mixture data order past the first block of source draws, and the absent ``grad_accum_steps``.

The per-update source draws come in blocks of 65,536 / batch_size updates (one generator per
block); the tests of ``tests/test_mixtures.py`` stay inside block 0 (1,500 updates of 16 rows,
a block being 4,096 updates). Here the batch is 16,384 rows, so a block is four updates and the
fifth update is the first of block 1. Every expectation is counted by the test from what the
batches hold: the row a draw read (stored rows carry their own index), the source it belongs
to (the stored source ranges) and the running sum of each source's draws over the updates
before; the code's own figures are then compared with these sums.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
from test_mixtures import synthetic, training

from minifield.data import batches as batches_module
from minifield.data import mixture

#: rows per source: large enough that two epochs of one source in the same order cannot be
#: chance (1 / 50! per pair of epochs)
SOURCE_ROWS = (50, 70, 110)
BATCH = 16_384
PER_BLOCK = 4
UPDATES = 5  # block 0 and the first update of block 1


@pytest.fixture(scope="module")
def read():
    """Per update: the rows read in draw order, each row's source (from the stored ranges)
    and the code's counts of draws before it; the draw order is
    :meth:`~minifield.data.batches.MixtureBatches.rows_and_sources`'."""
    assert mixture.steps_per_block(BATCH) == PER_BLOCK  # the premise
    arrays = synthetic(SOURCE_ROWS)
    mix = batches_module.MixtureBatches(arrays, training(BATCH))
    bounds = np.cumsum((0, *SOURCE_ROWS))
    out = []
    for step in range(UPDATES):
        rows, sources = mix.rows_and_sources(step)
        stored = arrays["train_tokens"][rows, 0]  # the row's own index, read from the row
        by_range = np.searchsorted(bounds, stored, side="right") - 1
        np.testing.assert_array_equal(by_range, sources)
        out.append((stored, by_range, mix.drawn.before(step)))
    return {"updates": out, "bounds": bounds, "mix": mix, "arrays": arrays}


def _per_source_sequences(read) -> list[np.ndarray]:
    """Each source's rows (indices within the source) in the order they were read."""
    bounds = read["bounds"]
    sequences = []
    for s in range(len(SOURCE_ROWS)):
        parts = [rows[sources == s] - bounds[s] for rows, sources, _ in read["updates"]]
        sequences.append(np.concatenate(parts))
    return sequences


def test_read_positions_carry_over_block_boundaries(read):
    """Reading a source continues where the previous update left it, across blocks: the
    code's count of draws before each update is the sum of the per-update draws before it
    (counted here from the rows), and each source's read sequence splits into whole epochs,
    each a permutation of its rows (a source re-read from its start at a block boundary
    breaks the epoch that boundary falls in)."""
    running = np.zeros(len(SOURCE_ROWS), np.int64)
    for step, (_, sources, before) in enumerate(read["updates"]):
        np.testing.assert_array_equal(before, running, err_msg=f"update {step}")
        running += np.bincount(sources, minlength=len(SOURCE_ROWS))
    np.testing.assert_array_equal(read["mix"].drawn.before(UPDATES), running)
    for s, (m, sequence) in enumerate(zip(SOURCE_ROWS, _per_source_sequences(read), strict=True)):
        # the premise: block 0's draws of this source end inside an epoch
        in_block_0 = sum(int((src == s).sum()) for _, src, _ in read["updates"][:PER_BLOCK])
        assert in_block_0 % m, (s, in_block_0)
        whole = len(sequence) // m
        epochs = sequence[: whole * m].reshape(whole, m)
        np.testing.assert_array_equal(np.sort(epochs, axis=1), np.tile(np.arange(m), (whole, 1)))
        # the last, partial epoch reads no row twice
        tail = sequence[whole * m :]
        assert len(np.unique(tail)) == len(tail)


def test_each_epoch_of_a_source_has_its_own_order(read):
    """A source's epochs are permutations drawn per epoch: no two epochs of a 50-, 70- or
    110-row source share an order (probability below 1e-60 per pair for a fair draw)."""
    for m, sequence in zip(SOURCE_ROWS, _per_source_sequences(read), strict=True):
        whole = len(sequence) // m
        assert whole > 100, whole  # hundreds of epochs per source
        epochs = sequence[: whole * m].reshape(whole, m)
        assert len(np.unique(epochs, axis=0)) == whole


def test_each_block_draws_its_own_sources(read):
    """The source schedule does not repeat from one block to the next: the first update of
    block 1 draws other sources than the first of block 0, and the shares over all five
    updates stay within 5 standard deviations of the weights."""
    updates = read["updates"]
    assert not np.array_equal(updates[PER_BLOCK][1], updates[0][1])
    counts = np.bincount(np.concatenate([u[1] for u in updates]), minlength=3)
    n = UPDATES * BATCH
    shares = np.array([5.0, 3.0, 2.0]) / 10.0  # test_mixtures' weights
    sigma = np.sqrt(n * shares * (1 - shares))
    assert (np.abs(counts - n * shares) <= 5 * sigma).all(), (counts, n * shares)


def test_a_process_starting_in_block_one_reads_the_same_rows(read):
    """A resume at update 4 (block 1) redraws block 0 and reads the rows the process that
    trained through it read."""
    fresh = batches_module.MixtureBatches(read["arrays"], training(BATCH))
    rows, _ = fresh.rows_and_sources(UPDATES - 1)
    np.testing.assert_array_equal(read["arrays"]["train_tokens"][rows, 0], read["updates"][-1][0])


#: the per-update draw's generator tag ("mix" in ASCII): part of the data order of every recipe
#: with a mixture, so changing it (or the block size) changes the rows of existing recipes
DRAW_TAG = 0x6D6978


@pytest.mark.parametrize(("batch_size", "per_block"), [(16_384, 4), (65_536, 1), (100_000, 1)])
def test_the_source_draws_are_the_documented_generator_draws(batch_size, per_block):
    """Block ``b`` holds about 65,536 draws (at least one update) from ``PCG64([seed, tag,
    b])``, one uniform per row, row ``j`` of update ``n`` its ``[n mod per_block, j]`` entry;
    the source is the categorical of the cumulative shares (a uniform below 0.5 is source 0,
    below 0.8 source 1, else source 2). Recomputed here from raw generator draws for the
    updates of two blocks and the first of a third, and the counts before each update are
    the running sums of those draws (with the draw cache emptied, so the counts draw the
    blocks themselves)."""
    seed, shares = 11, np.array([0.5, 0.3, 0.2])
    thresholds = np.array([0.5, 0.8])
    steps = 2 * per_block + 1
    expected = []
    for step in range(steps):
        block, within = divmod(step, per_block)
        uniform = np.random.Generator(np.random.PCG64([seed, DRAW_TAG, block])).random(
            (per_block, batch_size)
        )[within]
        expected.append((uniform[:, None] >= thresholds[None, :]).sum(axis=1))
    running = np.cumsum(
        [np.zeros(3, np.int64)] + [np.bincount(e, minlength=3) for e in expected], 0
    )
    mixture._block.cache_clear()
    counts = mixture.SourceCounts(seed, batch_size, shares)
    last = counts.before(steps)  # counts first: they draw every block themselves
    assert np.issubdtype(last.dtype, np.integer)
    np.testing.assert_array_equal(last, running[steps])
    for step in range(steps):
        np.testing.assert_array_equal(counts.before(step), running[step], err_msg=f"{step}")
        np.testing.assert_array_equal(
            mixture.sources_of_step(seed, step, batch_size, shares), expected[step]
        )


def test_epochs_are_the_documented_permutations():
    """Epoch ``e`` of source ``s`` reads its rows in the order of a permutation drawn from
    ``PCG64([seed, s + 1, e])`` (recomputed here from the generator): checked for the first
    epochs of each source as the batches read them."""
    arrays = synthetic((5, 7, 11))
    mix = batches_module.MixtureBatches(arrays, training(16))
    bounds = np.cumsum((0, 5, 7, 11))
    read = [[] for _ in range(3)]
    for step in range(12):
        rows, sources = mix.rows_and_sources(step)
        for row, s in zip(arrays["train_tokens"][rows, 0], sources, strict=True):
            read[s].append(row - bounds[s])
    for s, m in enumerate((5, 7, 11)):
        epochs = len(read[s]) // m
        assert epochs >= 3, (s, len(read[s]))
        expected = [
            np.random.Generator(np.random.PCG64([11, s + 1, e])).permutation(m)
            for e in range(epochs)
        ]
        np.testing.assert_array_equal(read[s][: epochs * m], np.concatenate(expected))


def test_without_a_mixture_the_one_train_input_has_all_the_weight():
    assert mixture.input_names({"batch_size": 8}) == ["train"]
    np.testing.assert_array_equal(mixture.weights({"batch_size": 8}), [1.0])


def test_an_absent_grad_accum_steps_is_one_micro_batch():
    """Absent means 1 (the schema's ``x-absent``): one micro-batch, and a batch of 3 rows,
    which no larger count divides, is accepted without it."""
    assert mixture.grad_accum_steps({"batch_size": 8}) == 1
    assert mixture.grad_accum_steps({"batch_size": 8, "grad_accum_steps": 4}) == 4
    recipe = {"training": {"batch_size": 3, "data_parallel": {"devices": 1}}}
    before = copy.deepcopy(recipe)
    assert mixture.normalize(recipe) == []
    assert recipe == before


@pytest.mark.parametrize(
    ("rows", "accum", "devices", "accepted"),
    [(3, 2, 1, False), (8, 2, 8, False), (8, 2, 4, True), (8, 2, 1, True), (6, 3, 2, True)],
)
def test_two_micro_batches_must_divide_the_batch_over_the_devices(rows, accum, devices, accepted):
    """``grad_accum_steps: 2`` is checked like any count above 1: 3 rows do not split in
    two, 8 rows in two micro-batches of 4 do not split over 8 devices, over 4 they do."""
    training = {
        "batch_size": rows,
        "grad_accum_steps": accum,
        "data_parallel": {"devices": devices},
    }
    errors = mixture.normalize({"training": training})
    assert (errors == []) is accepted, errors
    assert all(e["path"] == "/training/grad_accum_steps" for e in errors)
