"""The evaluate stage: every retained checkpoint scored on DEV, one state held at a time,
the DEV-selected checkpoint exported. Checked against the raw checkpoint files."""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest
from checkpoint_by_hand import verify_checkpoint_by_hand
from conftest import linear_recipe, run_worker, write_recipe

from minifield.pipeline import evaluation, preparation
from minifield.state import export
from minifield.strategies.linear_momentum.program import LinearProgram

pytestmark = pytest.mark.slow  # a worker run makes the checkpoints


def _checkpoint_params(checkpoint_dir) -> dict[str, np.ndarray]:
    """``params/*`` arrays of one checkpoint, read by hand from its manifest and data file."""
    _, arrays = verify_checkpoint_by_hand(checkpoint_dir)
    return {
        name.removeprefix("params/"): array
        for name, array in arrays.items()
        if name.startswith("params/")
    }


def test_evaluate_holds_one_checkpoint_at_a_time_and_exports_the_dev_selected_one(
    tmp_path, monkeypatch
):
    (tmp_path / "in").mkdir()
    job = write_recipe(
        tmp_path / "job.json",
        linear_recipe(limits={"max_steps": 12}, checkpoint={"every_steps": 2, "keep": 6}),
    )
    run_worker(
        job=job,
        input_root=tmp_path / "in",
        output_root=tmp_path / "out",
        attempt_id="a",
        check_codes=[0],
    )
    attempt = tmp_path / "out" / "linear-test" / "a"
    recipe_json = tmp_path / "recipe.json"
    preparation.validate(job, recipe_json, tmp_path / "validation.json")
    preparation.prepare(recipe_json, tmp_path / "in", tmp_path / "examples")
    result = json.loads((attempt / "result.json").read_text())
    train_result = tmp_path / "train-result.json"
    train_result.write_text(json.dumps({**result, "attempt_dir": str(attempt)}))

    # how many JAX arrays are alive whenever a checkpoint's DEV metrics are computed: the
    # same number each time if each checkpoint's state is dropped before the next is loaded
    alive = []
    scored = LinearProgram.evaluate

    def counting(self, state):
        alive.append(len(jax.live_arrays()))
        return scored(self, state)

    monkeypatch.setattr(LinearProgram, "evaluate", counting)
    metrics = evaluation.evaluate(
        recipe_json, train_result, tmp_path / "examples", tmp_path / "metrics.json",
        tmp_path / "selected-export",
    )  # fmt: skip
    steps = [row["step"] for row in metrics["checkpoints"]]
    assert steps == [2, 4, 6, 8, 10, 12]
    assert len(alive) == 6 and len(set(alive)) == 1, alive

    # DEV selection by hand: held-out MSE against y = 2x + 1 from each checkpoint's raw weights
    heldout = np.asarray(json.loads(recipe_json.read_text())["evaluation"]["heldout_x"])
    mse = {}
    for step in steps:
        params = _checkpoint_params(attempt / "checkpoints" / f"step-{step:08d}")
        w, b = float(params["w"][0]), float(params["b"][0])
        mse[step] = float(np.mean((w * heldout + b - (2 * heldout + 1)) ** 2))
    best = min(steps, key=lambda s: (mse[s], -s))
    assert metrics["selection"]["step"] == best
    # the selected checkpoint's weights, bit for bit, are what was exported
    exported, _ = export.read(tmp_path / "selected-export")
    expected = _checkpoint_params(attempt / "checkpoints" / f"step-{best:08d}")
    assert exported.keys() == expected.keys()
    for name, array in expected.items():
        np.testing.assert_array_equal(exported[name], array)


def test_evaluation_processes_load_the_workers_programs_from_its_compilation_cache(
    tmp_path, monkeypatch
):
    """The evaluate stage's own processes (an accelerator's recipe, or several processes) given
    the computation's compilation cache load the programs the worker's final evaluation
    compiled there, DEV's loss (``jit(<lambda>)``, ``Evaluator._loss``) and generation's decode
    (JAX's log of each cache hit), and give the figures of the stage's in-process scoring."""
    import re

    from test_base_model import base_recipe, make_inputs

    from minifield.pipeline import evaluation_processes
    from minifield.recipe import load

    root, cache = tmp_path / "in", tmp_path / "cache"
    make_inputs(root)
    job = write_recipe(tmp_path / "job.json", {**base_recipe(root, {}), "limits": {"max_steps": 2}})
    run_worker(job=job, input_root=root, output_root=tmp_path / "out", attempt_id="a",
               check_codes=[0], compilation_cache=cache)  # fmt: skip
    attempt = next((tmp_path / "out").glob("*/a"))
    recipe_json = tmp_path / "recipe.json"
    preparation.validate(job, recipe_json, tmp_path / "validation.json")
    preparation.prepare(recipe_json, root, tmp_path / "examples")
    result = json.loads((attempt / "result.json").read_text())
    train_result = tmp_path / "train-result.json"
    train_result.write_text(json.dumps({**result, "attempt_dir": str(attempt)}))
    in_process = evaluation.evaluate(
        recipe_json, train_result, tmp_path / "examples", tmp_path / "metrics.json"
    )
    monkeypatch.setenv("JAX_LOG_COMPILES", "1")  # the process logs each persistent-cache hit
    scores = evaluation_processes.run(
        load(recipe_json), recipe_json, train_result, tmp_path / "examples", None, 1,
        scratch=tmp_path / "scratch", log=tmp_path / "evaluation.log", compilation_cache=cache,
    )  # fmt: skip
    hits = re.findall(r"cache hit for '(\S+)'", (tmp_path / "evaluation.log").read_text())
    assert {"jit__lambda", "jit_decode"} <= set(hits), hits
    for key in ("checkpoints", "selection", "selected_dev", "test"):
        assert scores[key] == in_process[key], key
