"""A run whose loss becomes non-finite ends failed, cleanly, keeping only finite states.

The divergence is real: a line fit on x in [-1000, 1000] with the demo's learning rate, far
above the stable 2 / (largest curvature), grows the loss by ~1e9 per update until it
overflows FP32 — no fault is injected.
"""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

import numpy as np
import pytest
import yaml
from checkpoint_by_hand import verify_checkpoint_by_hand
from conftest import REPO, read_events, run_worker, write_recipe

import minifield


def _diverging_recipe(root: Path) -> dict:
    rows = [{"x": -1000 + 2000 * i / 63, "y": 2 * (-1000 + 2000 * i / 63) + 1} for i in range(64)]
    path = root / "lin" / "examples.jsonl"
    path.parent.mkdir(parents=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    recipe = yaml.safe_load((REPO / "config/recipes/linear-demo.yaml").read_text())
    recipe["inputs"][0].update(
        path="lin/examples.jsonl", sha256=hashlib.sha256(path.read_bytes()).hexdigest()
    )
    recipe["limits"]["max_steps"] = 20
    return recipe


def _check_clean_failure(attempt: Path) -> tuple[dict, list[dict]]:
    """The failure's independent evidence: the events (every line JSON), the files on disk."""
    events = read_events(attempt / "events.jsonl")
    result = json.loads((attempt / "result.json").read_text())
    updates = [e for e in events if e["type"] == "update"]
    # a real divergence: each reported update's loss is finite and far above the one before
    assert all(math.isfinite(e["loss"]) for e in updates)
    assert all(b["loss"] > 1e6 * a["loss"] for a, b in zip(updates, updates[1:], strict=False))
    last = updates[-1]["step"]
    (diverged,) = [e for e in events if e["type"] == "diverged"]
    assert diverged["step"] == last + 1 and diverged["value"] in ("inf", "nan")
    committed = [e for e in events if e["type"] == "checkpoint_committed"]
    newest = max(committed, key=lambda e: e["step"])
    assert result["status"] == "failed" and result["error"]["phase"] == "diverged"
    assert result["checkpoint"]["step"] == newest["step"] <= last
    assert result["steps_completed"] == last and result["final_state_hash"] is None
    assert result["error"]["message"] == (
        f"update {last + 1}: loss is {diverged['value']} (not finite): training diverged; the "
        f"last finite state is the committed checkpoint of step {newest['step']} "
        f"({newest['path']}); nothing was exported"
    )
    assert events[-1]["type"] == "failed" and events[-1]["phase"] == "diverged"
    # no checkpoint of the diverged update or later; every kept array is finite; no export
    steps = sorted(int(p.name.split("-")[1]) for p in (attempt / "checkpoints").iterdir())
    assert steps and max(steps) <= last
    for checkpoint in (attempt / "checkpoints").iterdir():
        _, arrays = verify_checkpoint_by_hand(checkpoint)
        assert arrays
        for value in arrays.values():
            assert not np.issubdtype(value.dtype, np.floating) or np.isfinite(value).all()
    assert not (attempt / "export").exists()
    return result, events


@pytest.mark.slow
def test_a_diverging_run_ends_failed_naming_the_update_and_the_last_checkpoint(tmp_path):
    recipe = _diverging_recipe(tmp_path / "in")
    path = write_recipe(tmp_path / "recipe.json", recipe)
    proc = run_worker(
        job=path, input_root=tmp_path / "in", output_root=tmp_path / "out", check_codes=(1,)
    )
    (attempt,) = (tmp_path / "out" / recipe["job_id"]).iterdir()
    result, _ = _check_clean_failure(attempt)
    assert "Traceback" not in proc.stderr
    assert f"minifield-worker: update {result['steps_completed'] + 1}: loss is" in proc.stderr


def test_the_api_reports_a_divergence_as_a_failed_result(tmp_path):
    recipe = _diverging_recipe(tmp_path / "in")
    run = minifield.run(recipe, input_root=tmp_path / "in", output_root=tmp_path / "out")
    assert (run.status, run.exit_code) == ("failed", 1)
    result, _ = _check_clean_failure(Path(run.attempt_dir))
    assert run.error == result["error"] and run.checkpoint == result["checkpoint"]
    assert run.final_state_hash is None and run.steps_completed == result["steps_completed"]


@pytest.mark.slow
def test_a_base_model_whose_gradient_overflows_fails_at_the_first_update(tmp_path):
    """Finite base weights, lm_head scaled by 1e30: the loss (~1e31) is still finite, but the
    gradient reaching the hidden states is ~1e30 per element, whose squares overflow FP32
    (max ~3.4e38) in the global norm. Nothing is committed, nothing exported."""
    from safetensors.numpy import load_file, save_file
    from test_base_model import base_recipe, make_inputs

    root = tmp_path / "in"
    make_inputs(root)
    weights = root / "base" / "model.safetensors"
    tensors = load_file(weights)
    tensors["lm_head.weight"] *= np.float32(1e30)
    assert all(np.isfinite(t).all() for t in tensors.values())
    save_file(tensors, str(weights), {"format": "pt"})
    path = write_recipe(tmp_path / "recipe.json", base_recipe(root))
    proc = run_worker(job=path, input_root=root, output_root=tmp_path / "out", check_codes=(1,))
    (attempt,) = (tmp_path / "out" / "base-test").iterdir()
    result = json.loads((attempt / "result.json").read_text())
    assert result["status"] == "failed" and result["steps_completed"] == 0
    assert result["error"] == {
        "phase": "diverged",
        "message": "update 1: grad_norm is inf (not finite): training diverged; no checkpoint "
        "was committed; nothing was exported",
    }
    events = read_events(attempt / "events.jsonl")
    assert not [e for e in events if e["type"] in ("update", "checkpoint_committed")]
    assert [e["type"] for e in events[-2:]] == ["diverged", "failed"]
    checkpoints = attempt / "checkpoints"
    assert not (attempt / "export").exists()
    assert not checkpoints.exists() or not list(checkpoints.iterdir())
    assert "Traceback" not in proc.stderr


def test_a_non_finite_evaluation_is_a_divergence_before_its_event():
    """No real run reaches it here (a finite update's state evaluates finite on these
    recipes); the check the periodic and the final evaluation make before their event."""
    from minifield.attempt.update_loop import Diverged, check_evaluation

    check_evaluation(3, {"dev_loss": 2.5, "dev_exact_match": 1.0, "note": "x"})
    with pytest.raises(Diverged, match=r"^update 3: the evaluation's dev_perplexity is inf \("):
        check_evaluation(3, {"dev_loss": 701.0, "dev_perplexity": math.inf})


@pytest.mark.slow
def test_the_train_stage_reports_a_divergence_and_that_a_retry_cannot_fix_it(tmp_path):
    """The pipeline's train stage (supervisor + worker, as Snakemake runs it) fails with the
    attempt's reason and says that resuming would diverge again; nothing is exported."""
    from minifield.pipeline import errors, preparation, training

    recipe = _diverging_recipe(tmp_path / "in")
    source = write_recipe(tmp_path / "source.json", recipe)
    recipe_json = tmp_path / "recipe.json"
    preparation.validate(source, recipe_json, tmp_path / "validation.json")
    preparation.prepare(recipe_json, tmp_path / "in", tmp_path / "examples")
    with pytest.raises(errors.StageError) as info:
        training.train_attempt(
            recipe_json,
            tmp_path / "in",
            tmp_path / "examples",
            tmp_path / "work",
            tmp_path / "train" / "result.json",
            tmp_path / "train" / "export",
            tmp_path / "train.log",
        )
    (attempt,) = (tmp_path / "work" / "attempts" / recipe["job_id"]).iterdir()
    result = json.loads((attempt / "result.json").read_text())
    assert str(info.value) == (
        f"training attempt {attempt} ended failed (supervisor: failed, exit 1): diverged: "
        f"{result['error']['message']}; a retry diverges again: change the recipe (learning "
        f"rate, base model) first. Log: {tmp_path / 'train.log'}"
    )
    assert not (tmp_path / "train").exists()
