"""Data parallelism on one host (``training.data_parallel``), through the real worker on CPU
with forced host devices (``XLA_FLAGS=--xla_force_host_platform_device_count=N``).

- the 4-device loss curve matches the 1-device run to a stated tolerance;
- SIGKILL (during a checkpoint write) and resume on the same 4 devices is bit-identical;
- resuming under a different visible device count is refused unless overridden, and a
  different data-parallel degree is a different computation;
- fewer visible devices than the recipe asks for fails in phase ``device``.

Tolerance: the two runs train on the same rows from the same initial parameters; the
only difference is the order of floating-point additions (per-device partial sums of
the loss and the gradients, then an all-reduce). Update 1 is computed from identical
parameters, so its loss differs only by the order of one FP32 sum: relative 1e-6
(a few ulps at the loss's size). Later updates inherit the parameter differences,
which AdamW's per-coordinate normalisation amplifies (tiny gradient entries are divided
by their own tiny root mean square), so over this short run we allow relative 1e-3 — a
wide margin over the ~3e-5 seen here, and still 100x below the loss's change per update.
"""

from __future__ import annotations

import json
import signal
from pathlib import Path

import numpy as np
import pytest
from conftest import (
    attempts_of,
    in_a_started_process,
    read_events,
    run_attempt,
    small_sft_inputs,
    small_sft_recipe,
    started_xla_flags,
    write_recipe,
)

from minifield import recipe as recipes
from minifield.training import data_parallel

MAX_STEPS = 6
BATCH = 8
FIRST_UPDATE_RTOL = 1e-6
CURVE_RTOL = 1e-3


def devices_env(count: int) -> dict:
    """CPU only, with ``count`` host devices (no forced count for one device), compiled with
    the session's light flags like every process the suite starts: every run these tests
    compare to the bit is started through here, so all compile alike."""
    forced = [f"--xla_force_host_platform_device_count={count}"] if count > 1 else []
    return {"JAX_PLATFORMS": "cpu", "XLA_FLAGS": started_xla_flags(*forced)}


@pytest.fixture(scope="module")
def space(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("data-parallel")
    return {"root": root, **small_sft_inputs(root), "cache": root / "jax-cache"}


def dp_recipe(space, devices: int, shard_params: bool = False) -> dict:
    recipe = small_sft_recipe(
        space["pins"],
        "dp-test",
        devices,
        training={
            "batch_size": BATCH,
            "data_parallel": {"devices": devices, "shard_params": shard_params},
        },
        limits={"max_steps": MAX_STEPS},
    )
    # no greedy generation in the final evaluations: these tests read losses, hashes and the
    # DEV loss, never an exact match (each completed run compiled and decoded it for nothing)
    recipe["evaluation"]["max_generate_examples"] = 0
    return recipe


def _run(space, recipe_path, out, visible: int, *extra, codes=(0,)):
    return run_attempt(
        recipe_path, space["input_root"], out, *extra, codes=codes, cache=space["cache"],
        env=devices_env(visible),
    )  # fmt: skip


def _attempts(out: Path) -> list[Path]:
    return attempts_of(out, "dp-test")


def _updates(attempt: Path) -> list[dict]:
    return [e for e in read_events(attempt / "events.jsonl") if e["type"] == "update"]


def _result(attempt: Path) -> dict:
    return json.loads((attempt / "result.json").read_text())


def _single_run(space, name: str, devices: int, shard_params: bool = False) -> dict:
    recipe_path = write_recipe(
        space["root"] / f"{name}.json", dp_recipe(space, devices, shard_params)
    )
    out = space["root"] / name
    _run(space, recipe_path, out, devices)
    (attempt,) = _attempts(out)
    return {"recipe": recipe_path, "attempt": attempt, "result": _result(attempt)}


@pytest.fixture(scope="module")
def one(space) -> dict:
    return _single_run(space, "one", 1)


@pytest.fixture(scope="module")
def four(space) -> dict:
    return _single_run(space, "four", 4)


# -- validation (in process: no devices needed) -------------------------------------------------


def test_data_parallel_settings_validate_and_define_the_computation(space):
    implicit = dp_recipe(space, 1)
    del implicit["training"]["data_parallel"]
    plain = recipes.validate(implicit)
    assert plain.data["training"]["data_parallel"] == {"devices": 1, "shard_params": False}
    spelled = recipes.validate(dp_recipe(space, 1))
    four = recipes.validate(dp_recipe(space, 4))
    sharded = recipes.validate(dp_recipe(space, 4, shard_params=True))
    # a spelled-out default is the same computation; another device count is not
    assert plain.computation_digest == spelled.computation_digest
    digests = {spelled.computation_digest, four.computation_digest, sharded.computation_digest}
    assert len(digests) == 3
    # the prepared examples do not depend on the device count
    assert spelled.examples_digest == four.examples_digest == sharded.examples_digest
    assert four.strategy.devices_required(four.data) == 4

    with pytest.raises(recipes.RecipeError) as info:
        recipes.validate(dp_recipe(space, 3))
    errors = {e["path"]: e["message"] for e in info.value.errors}
    assert list(errors) == ["/training/data_parallel/devices"]
    assert "must divide training.batch_size=8" in errors["/training/data_parallel/devices"]
    bad = dp_recipe(space, 0)
    bad["training"]["data_parallel"]["colour"] = "red"
    with pytest.raises(recipes.RecipeError) as info:
        recipes.validate(bad)
    paths = [e["path"] for e in info.value.errors]
    assert "/training/data_parallel/devices" in paths and "/training/data_parallel" in paths


def test_sharding_rule_splits_the_first_axis_the_device_count_divides():
    dp = data_parallel.DataParallel(devices=4, shard_params=True)
    assert dp._leaf_spec((260, 32)) == data_parallel.PartitionSpec("data")
    assert dp._leaf_spec((3, 32)) == data_parallel.PartitionSpec(None, "data")
    assert dp._leaf_spec((3, 5)) == data_parallel.PartitionSpec()
    assert dp._leaf_spec((2,)) == data_parallel.PartitionSpec()  # smaller than the mesh


# -- 1 device vs 4 devices ----------------------------------------------------------------------


@pytest.mark.slow
def test_four_device_loss_curve_matches_one_device_within_tolerance(one, four):
    a, b = _updates(one["attempt"]), _updates(four["attempt"])
    assert [e["step"] for e in a] == [e["step"] for e in b] == list(range(1, MAX_STEPS + 1))
    # the same rows every update: the data order does not depend on the device count
    for key in ("examples", "tokens", "loss_tokens"):
        assert [e[key] for e in a] == [e[key] for e in b]
    loss_a = np.array([e["loss"] for e in a])
    loss_b = np.array([e["loss"] for e in b])
    relative = np.abs(loss_a - loss_b) / np.abs(loss_a)
    assert relative[0] <= FIRST_UPDATE_RTOL, relative
    assert relative.max() <= CURVE_RTOL, relative
    # and the losses do move by far more than the tolerance (the check is not vacuous)
    assert np.min(np.abs(np.diff(loss_a)) / loss_a[1:]) > 10 * CURVE_RTOL
    # ... but the bits differ: the device count is part of the computation
    assert one["result"]["computation_digest"] != four["result"]["computation_digest"]
    assert one["result"]["final_state_hash"] != four["result"]["final_state_hash"]

    events = read_events(four["attempt"] / "events.jsonl")
    device = next(e for e in events if e["type"] == "device")
    assert device["device_count"] == 4 and device["data_parallel_devices"] == 4
    placement = next(e for e in events if e["type"] == "compiled")["placement"]
    assert placement["devices"] == 4 and placement["sharded_arrays"] == 0
    assert four["result"]["environment"]["device_count"] == 4
    plain = next(e for e in read_events(one["attempt"] / "events.jsonl") if e["type"] == "compiled")
    assert plain["placement"] is None


@pytest.mark.slow
def test_sharded_parameters_train_the_same_curve(space, one):
    sharded = _single_run(space, "four-sharded", 4, shard_params=True)
    events = read_events(sharded["attempt"] / "events.jsonl")
    placement = next(e for e in events if e["type"] == "compiled")["placement"]
    # every parameter and moment array of this model has an axis 4 divides; the scalars
    # (step, cursor, optimizer counts) and the RNG key stay replicated
    assert placement["shard_params"] and placement["sharded_arrays"] > 0
    assert placement["replicated_arrays"] >= 3
    loss_a = np.array([e["loss"] for e in _updates(one["attempt"])])
    loss_b = np.array([e["loss"] for e in _updates(sharded["attempt"])])
    assert np.max(np.abs(loss_a - loss_b) / loss_a) <= CURVE_RTOL
    # checkpoints hold whole (gathered) arrays: the export has the full embedding table
    model = json.loads((sharded["attempt"] / "export" / "model.json").read_text())
    shapes = {w["name"]: w["shape"] for w in model["weights"]}
    assert [260, 32] in shapes.values()


# -- resume on 4 devices, and on another device count ----------------------------------------------


@pytest.fixture(scope="module")
def crashed(space, four) -> Path:
    """A 4-device attempt SIGKILLed half-way through writing its step-4 checkpoint."""
    out = space["root"] / "crash"
    proc = _run(
        space, four["recipe"], out, 4, "--kill-during-checkpoint", "4", codes=(-signal.SIGKILL,)
    )
    assert proc.returncode == -signal.SIGKILL
    (attempt,) = _attempts(out)
    assert not (attempt / "result.json").exists()
    assert (attempt / "checkpoints" / "step-00000002" / "manifest.json").is_file()
    assert not (attempt / "checkpoints" / "step-00000004").exists()
    return attempt


@pytest.mark.slow
def test_resume_on_the_same_four_devices_is_bit_identical(space, four, crashed):
    out = crashed.parent.parent
    _run(space, four["recipe"], out, 4, "--resume-from", crashed)
    resumed = _attempts(out)[-1]
    result = _result(resumed)
    assert result["status"] == "completed" and result["environment_override"] is None
    assert result["final_state_hash"] == four["result"]["final_state_hash"]
    restored = [e for e in read_events(resumed / "events.jsonl") if e["type"] == "restored"]
    assert restored[0]["step"] == 2
    # every update's complete-state hash, before the crash and after the resume
    hashes = {e["step"]: e["state_hash"] for e in _updates(crashed)}
    hashes.update({e["step"]: e["state_hash"] for e in _updates(resumed)})
    assert hashes == {e["step"]: e["state_hash"] for e in _updates(four["attempt"])}
    # the restored state was placed on the mesh again: the resumed update ran 4-way
    placement = next(e for e in read_events(resumed / "events.jsonl") if e["type"] == "compiled")
    assert placement["placement"]["devices"] == 4


@pytest.mark.slow
def test_resume_on_another_device_count_is_refused_unless_overridden(space, four, crashed):
    out = space["root"] / "other-count"
    proc = _run(space, four["recipe"], out, 2, "--resume-from", crashed, codes=(2,))
    assert "the environment changed" in proc.stderr
    assert "device_count: 4 -> 2" in proc.stderr and "--allow-environment-change" in proc.stderr
    (refused,) = _attempts(out)
    assert _result(refused)["error"]["phase"] == "resume"

    # overridden, the resume goes ahead, and then the recipe's 4 devices are not there
    proc = _run(
        space,
        four["recipe"],
        out,
        2,
        "--resume-from",
        crashed,
        "--allow-environment-change",
        codes=(1,),
    )
    failed = _attempts(out)[-1]
    result = _result(failed)
    assert result["error"]["phase"] == "device"
    assert "training.data_parallel.devices=4 but only 2 device(s)" in result["error"]["message"]
    assert result["environment_override"]["device_count"] == {"recorded": 4, "current": 2}
    assert not (failed / "checkpoints").exists()  # nothing trained

    # overridden with more devices visible than the recipe's 4: the resume completes and the
    # override stays on the record
    proc = _run(
        space, four["recipe"], out, 8, "--resume-from", crashed, "--allow-environment-change"
    )
    result = _result(_attempts(out)[-1])
    assert result["status"] == "completed" and result["steps_completed"] == MAX_STEPS
    assert result["environment_override"]["device_count"] == {"recorded": 4, "current": 8}
    assert result["environment"]["device_count"] == 8


@pytest.mark.slow
def test_another_data_parallel_degree_is_another_computation(space, crashed):
    two = write_recipe(space["root"] / "two.json", dp_recipe(space, 2))
    out = space["root"] / "other-degree"
    proc = _run(space, two, out, 4, "--resume-from", crashed, codes=(2,))
    assert (
        "refusing to resume" in proc.stderr
        and "a changed recipe is a new computation" in proc.stderr
    )


@pytest.mark.slow
def test_fewer_visible_devices_than_requested_fails_in_phase_device(space, four):
    out = space["root"] / "too-few"
    proc = _run(space, four["recipe"], out, 1, codes=(1,))
    assert "failed in phase device" in proc.stderr
    result = _result(_attempts(out)[0])
    assert result["status"] == "failed" and result["error"]["phase"] == "device"
    assert "XLA_FLAGS=--xla_force_host_platform_device_count=4" in result["error"]["message"]


@pytest.mark.slow
def test_a_data_parallel_checkpoint_evaluates_without_the_mesh(four):
    """The evaluate stage and the store load checkpoints in a plain process (one device is
    enough): only an update needs the mesh. The worker evaluated on the 4-device mesh
    (rows split over the devices, another grouping of the FP32 sums): within 1e-6 relative.
    The plain process is started as the worker was (its compile settings: like with like)."""
    recipe, checkpoint = four["recipe"], four["result"]["checkpoint"]["path"]
    evaluated = in_a_started_process(EVALUATE_WITHOUT_THE_MESH, recipe, checkpoint)
    assert evaluated["state_hash"] == four["result"]["final_state_hash"]
    dev_loss = evaluated["metrics"]["dev_loss"]
    assert dev_loss == pytest.approx(four["result"]["metrics"]["dev_loss"], rel=1e-6)


#: a checkpoint (argv 2) of the recipe (argv 1, its inputs under ``in/`` beside it) restored
#: into the template the evaluate stage restores into (shapes and dtypes, nothing computed: an
#: initial state made op by op cost more CPU than the evaluation) and evaluated, on one device
EVALUATE_WITHOUT_THE_MESH = """
import json, sys
from pathlib import Path
from minifield import recipe as recipes
from minifield.inputs import pinned
from minifield.state import checkpoint

path = Path(sys.argv[1])
recipe = recipes.load(path)
files = pinned.files_by_name(recipe.data, path.parent / "in")
program = recipe.strategy.build(recipe.data, recipe.strategy.prepare(recipe.data, files)[0])
state, manifest = checkpoint.load(
    Path(sys.argv[2]), program.state_template(), computation_digest=recipe.computation_digest
)
metrics = program.evaluate(state)
print(json.dumps({"state_hash": manifest["state_hash"], "metrics": metrics}, default=float))
"""
