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
    for array in (attempt / "checkpoints").rglob("*.npy"):
        value = np.load(array)
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
