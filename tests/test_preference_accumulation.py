"""Preference tuning with gradient accumulation (``training.grad_accum_steps``) in process, and
how an update's pairs split over devices and micro-batches; the reference product's address
on a mesh.

The update's loss is the mean over its P pairs of each pair's loss, and a pair's loss reads
that pair's answers only (SimPO/ORPO divide by the pair's own answer lengths), so its
gradient is ``(1/P) Σ_m ∇ Σ_{i∈m} ℓ_i``: the micro-batches' gradients of their loss sums,
added, divided once by P. Two micro-batches are then the one-batch update within FP32
rounding (another order of additions), for each loss: the same metrics and, after two
updates, the same parameters. The one-batch update itself is checked against the float64
NumPy forward in tests/test_preference_program.py.

Tolerances (tests/preference_mesh_cases.py, shared with the two-device runs): metrics to
relative 2e-5 (measured here 8e-7 at most; update 1 the same bits), parameters to 1e-5 of the
largest one (measured 7.5e-8, the largest about 1.6), AdamW's eps 1e-4 as in
tests/test_grad_accum.py. The pairs' answers are both unlikely under the base
(``make_mesh_inputs``: summed log-probabilities of −10 to −50), so no loss is evaluated where
FP32 has no digits left.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
from preference_cases import recipe
from preference_mesh_cases import LOSSES, close_runs, make_mesh_inputs, run, training

from minifield import recipe as recipes
from minifield.inputs import pinned
from minifield.strategies.preference.batches import PairBatches
from minifield.training.train_step import micro_batches


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return make_mesh_inputs(tmp_path_factory.mktemp("accum") / "in")


# ~10 CPU-s each (SimPO's 4.8 s under 3.12): every loss in the full suite only, where 3.12's
# fast tier is at its limit; the fast tier's accumulation check is test_grad_accum's
@pytest.mark.slow
@pytest.mark.parametrize("loss", LOSSES)
def test_two_micro_batches_are_the_one_batch_update(root, loss):
    close_runs(loss, run(root, loss), run(root, loss, None, 2))


def test_each_device_and_micro_batch_reads_its_own_whole_pairs(root):
    """8 pairs an update over 2 devices x 2 micro-batches: every (device, micro-batch) block
    of rows holds 2 whole pairs (both answers in one row), and together the update's pairs,
    the ones the one-group packing holds."""
    devices, k, size = 2, 2, 8
    loaded = recipes.validate(
        recipe(root, {"loss": "simpo"}, training={"batch_size": size, **training()})
    )
    arrays, _ = loaded.strategy.prepare(loaded.data, pinned.files_by_name(loaded.data, root))
    settings = loaded.data["training"]
    plain = PairBatches(arrays, settings, 6, 0)
    split = PairBatches(arrays, settings, 6, 0, devices, k)
    for step in range(6):
        batch, whole = split.batch(step), plain.batch(step)
        assert batch.tokens.shape[0] == split.rows == devices * k * split.group_rows
        assert batch.pair_index.shape[1] == size // (devices * k)
        held = []
        for block in np.split(np.arange(split.rows), devices):  # a device's rows
            on_device = micro_batches(jax.tree_util.tree_map(lambda v, b=block: v[b], batch), k)
            for m in range(k):
                index, segments = on_device.pair_index[m], on_device.segments[m]
                ids = index[index >= 0]
                assert len(ids) == size // (devices * k)
                for row, slot in zip(*np.nonzero(index >= 0), strict=True):
                    for segment in (2 * slot + 1, 2 * slot + 2):
                        assert np.any(segments[row] == segment)
                held += ids.tolist()
        assert sorted(held) == sorted(whole.pair_index[whole.pair_index >= 0].tolist())


def test_every_batch_holds_its_slots_reference_in_one_structure(root):
    """With reference log-probabilities prepared (made up here: pair i's chosen -i - 0.25, its
    rejected -i - 0.5), each pair slot of every update holds its own pair's, 0 where the slot
    is empty, in one layout (G = 1) and in the devices' x micro-batches' one (G = 4); every
    update has the same fields and shapes (one compiled program). Without a reference the
    fields hold no array."""
    loaded = recipes.validate(
        recipe(root, {"loss": "simpo"}, training={"batch_size": 8, **training()})
    )
    arrays, _ = loaded.strategy.prepare(loaded.data, pinned.files_by_name(loaded.data, root))
    settings = loaded.data["training"]
    assert PairBatches(arrays, settings, 6, 0).batch(0).ref_chosen is None
    index = arrays["train_pair_index"]
    for name, offset in (("ref_chosen", 0.25), ("ref_rejected", 0.5)):
        arrays[f"train_{name}"] = np.where(index >= 0, -index - offset, 0.0).astype(np.float32)
    for batches in (PairBatches(arrays, settings, 6, 0), PairBatches(arrays, settings, 6, 0, 2, 2)):
        layouts = set()
        for step in range(6):
            batch = batches.batch(step)
            held = batch.pair_index >= 0
            np.testing.assert_array_equal(
                batch.ref_chosen, np.where(held, -batch.pair_index - 0.25, 0)
            )
            np.testing.assert_array_equal(
                batch.ref_rejected, np.where(held, -batch.pair_index - 0.5, 0)
            )
            layouts.add(tuple((type(v), v.shape, v.dtype) for v in batch))
        assert len(layouts) == 1, layouts


@pytest.mark.parametrize(
    ("settings", "pointer", "words"),
    [
        ({"data_parallel": {"devices": 3}}, "/training/data_parallel/devices", "batch_size=4"),
        ({"grad_accum_steps": 3}, "/training/grad_accum_steps", "multiple of devices"),
        (
            {"data_parallel": {"devices": 2}, "grad_accum_steps": 4},
            "/training/grad_accum_steps",
            "devices x grad_accum_steps = 8",
        ),
    ],
)
def test_pairs_that_do_not_split_evenly_are_refused_naming_the_field(
    root, settings, pointer, words
):
    with pytest.raises(recipes.RecipeError) as caught:
        recipes.validate(recipe(root, {"loss": "simpo"}, training=settings))
    named = {e["path"]: e["message"] for e in caught.value.errors}
    assert pointer in named and words in named[pointer], caught.value.errors


def test_one_micro_batch_is_the_recipe_without_accumulation(root):
    plain = recipes.validate(recipe(root, {"loss": "simpo"}))
    one = recipes.validate(recipe(root, {"loss": "simpo"}, training={"grad_accum_steps": 1}))
    two = recipes.validate(recipe(root, {"loss": "simpo"}, training={"grad_accum_steps": 2}))
    assert plain.computation_digest == one.computation_digest != two.computation_digest


def test_the_reference_address_holds_the_mesh_only_above_one_device(root):
    """One device: the spec of every product computed before (no ``data_parallel`` key, so
    the same address); two devices: another address, replicated or sharded."""
    from minifield.strategies.preference import reference

    def digest(**data_parallel):
        document = recipe(root, {"loss": "simpo"}, training={"data_parallel": data_parallel})
        loaded = recipes.validate(document)
        return reference.spec(loaded.data), reference.reference_digest(loaded, root)

    (spec, one), (_, plain) = digest(devices=1), digest()
    assert "data_parallel" not in spec and one == plain
    assert digest(devices=1, shard_params=True)[1] == one  # nothing is sharded on one device
    (spec_two, two), (_, sharded) = digest(devices=2), digest(devices=2, shard_params=True)
    assert spec_two["data_parallel"] == {"devices": 2, "shard_params": False}
    assert len({one, two, sharded}) == 3
    assert {k: v for k, v in spec_two.items() if k != "data_parallel"} == spec
