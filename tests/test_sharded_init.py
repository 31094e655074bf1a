"""Sharded initialisation and evaluation on the data-parallel mesh (``shard_params: true``),
checked as properties of the placement, in one process that sees 4 forced host devices
(``tests/sharded_init_probe.py`` reports, this module judges):

- the fresh state is created in its shardings: every sharded leaf's per-device slices are
  1/4 of the leaf, and the compiled initialisation never holds a whole leaf on a device (its
  largest array is a slice, its outputs plus temporaries are less than one copy of the state);
- its complete-state hash equals the hash of the plain one-device initialisation;
- a restored checkpoint stays on the host until placed slice by slice, a base model's host
  weights likewise, both with the one-device hash; a checkpoint written and read back into
  the program's abstract template (what a resume restores into: shapes and shardings, no
  array) is placed the same way, with the same hash;
- (in process) the scaled normal draw compiled into a program gives the op-by-op bits: what
  lets the sharded state keep the one-device hash;
- evaluation runs with the parameters still sharded, its DEV loss within 1e-6 relative of
  one-device evaluation (a different grouping of FP32 sums), and greedy generation on the mesh
  gives the same tokens.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import small_sft_inputs, small_sft_recipe, write_recipe

DEVICES = 4
PROBE = Path(__file__).with_name("sharded_init_probe.py")


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("sharded-init")
    space = small_sft_inputs(root)
    recipe = small_sft_recipe(
        space["pins"],
        "sharded-init",
        DEVICES,
        training={"data_parallel": {"devices": DEVICES, "shard_params": True}},
        # 6 rows per evaluation batch: not a multiple of 4, so the mesh pads each batch
        evaluation={"eval_every": 0, "batch_size": 6, "max_generate_examples": 4},
    )
    path = write_recipe(root / "recipe.json", recipe)
    env = {
        "JAX_PLATFORMS": "cpu",
        "XLA_FLAGS": f"--xla_force_host_platform_device_count={DEVICES}",
        "PATH": "/usr/bin:/bin",
    }
    proc = subprocess.run(
        [sys.executable, str(PROBE), str(path)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=Path(__file__).parent,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _assert_sliced(leaves: list[dict]) -> None:
    """Every leaf on all 4 devices; a sharded one as four quarters, none whole on device 0."""
    assert leaves
    sharded = [leaf for leaf in leaves if not leaf["replicated"]]
    assert len(sharded) >= len(leaves) // 2, "shard_params shards most arrays"
    for leaf in leaves:
        assert leaf["devices"] == list(range(DEVICES)), leaf["name"]
        assert len(leaf["shard_sizes"]) == DEVICES, leaf["name"]
    for leaf in sharded:
        assert leaf["shard_sizes"] == [leaf["size"] // DEVICES] * DEVICES, leaf["name"]


@pytest.mark.slow
def test_the_fresh_state_is_created_in_its_shardings(report):
    _assert_sliced(report["fresh"])
    # the update's own state is the one created: placing it moves nothing
    assert report["placed_is_fresh"]
    compiled = report["compiled"]
    largest_leaf = max(leaf["size"] for leaf in report["fresh"])
    largest_slice = max(max(leaf["shard_sizes"]) for leaf in report["fresh"])
    assert compiled["largest_array"] == largest_slice < largest_leaf
    assert compiled["output_bytes"] + compiled["temp_bytes"] < report["state_bytes"]


@pytest.mark.slow
def test_the_sharded_state_has_the_one_device_bits(report):
    assert report["one_device_devices"] == [0]
    assert report["mesh_hash"] == report["one_device_hash"]


@pytest.mark.slow
def test_restored_and_base_model_states_are_placed_slice_by_slice(report):
    assert report["restored_on_host"]
    _assert_sliced(report["restored"])
    assert report["restored_hash"] == report["one_device_hash"]
    _assert_sliced(report["base"])
    assert report["base_hash"] == report["base_one_device_hash"] != report["one_device_hash"]


@pytest.mark.slow
def test_a_checkpoint_restores_into_an_abstract_template_slice_by_slice(report):
    """The template a resume restores into (``Program.state_template``) holds no array: a
    restore holds the restored state alone, never a fresh one beside it."""
    assert report["template_abstract"]
    assert report["template_matches_fresh"]
    _assert_sliced(report["template_restored"])
    assert report["template_restored_hash"] == report["one_device_hash"]


@pytest.mark.slow
def test_evaluation_runs_on_the_mesh(report):
    _assert_sliced(report["eval_params"])
    mesh, one = report["eval_mesh"], report["eval_one"]
    assert mesh["loss"] == pytest.approx(one["loss"], rel=1e-6)
    assert report["generated_mesh"] == report["generated_one"]
    assert all(len(tokens) == 8 for tokens in report["generated_one"])


def test_a_compiled_scaled_normal_has_the_op_by_op_bits():
    """One device, no mesh: inside one compiled program XLA sees the sampler's constant and
    the scale together and folded them (a last-bit change) before ``model.scaled_normal``'s
    barrier. The GPT and Llama initialisations draw every matrix through it; the slow tests
    above compare whole initial states."""
    import jax

    from minifield.models.layers.primitives import scaled_normal

    key = jax.random.key(11)
    for shape, std in (((260, 32), 0.02), ((32, 96), 32**-0.5)):
        op_by_op = np.asarray(scaled_normal(key, shape, std))
        compiled = np.asarray(jax.jit(lambda: scaled_normal(key, shape, std))())  # noqa: B023
        assert np.array_equal(op_by_op, compiled), (shape, std)


@pytest.mark.slow
def test_stacked_layers_are_split_within_each_layer_never_along_the_layer_axis(report):
    """With ``scan_layers`` the blocks are held ``[layers, ...]``: the scan takes one layer per
    iteration, so a split along that axis would leave whole layers on single devices. Here
    4 layers on 4 devices: the layer axis is divisible, and must still not be the one split."""
    stacked = [leaf for leaf in report["scanned"] if "'stacked'" in leaf["name"]]
    assert stacked and all(leaf["shape"][0] == 4 for leaf in stacked)
    split = [leaf for leaf in stacked if "data" in leaf["spec"]]
    assert len(split) >= len(stacked) // 2, stacked
    for leaf in split:
        axis = leaf["spec"].index("data")
        assert axis >= 1 and leaf["shape"][axis] % DEVICES == 0, leaf
    # an unstacked leaf (the embedding) is still split along its first divisible axis
    embedding = next(leaf for leaf in report["scanned"] if "'stacked'" not in leaf["name"])
    first = next(i for i, n in enumerate(embedding["shape"]) if n % DEVICES == 0)
    assert embedding["spec"][first] == "data", embedding
