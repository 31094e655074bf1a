"""The Python API (minifield.validate / minifield.run) against the worker command and by hand."""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import THIS_PROCESS, compiled_as, linear_recipe, run_worker, write_recipe

import minifield

ROOT = Path(__file__).resolve().parents[1]
LINEAR_DEMO = ROOT / "config" / "recipes" / "linear-demo.yaml"
DATA = ROOT / "data"


@pytest.fixture(scope="module")
def worker_reference(tmp_path_factory) -> dict:
    """The linear demo through a real minifield-worker process: its verdict and its result."""
    out = tmp_path_factory.mktemp("worker")
    verdict = json.loads(
        run_worker("--job", LINEAR_DEMO, "--validate-only", check_codes=[0]).stdout
    )
    run_worker(
        "--job", LINEAR_DEMO, "--input-root", DATA, "--output-root", out, "--attempt-id", "w1",
        check_codes=[0], env=compiled_as(THIS_PROCESS),  # the API runs in this process
    )  # fmt: skip
    result = json.loads((out / "linear-demo" / "w1" / "result.json").read_text())
    return {"verdict": verdict, "result": result}


@pytest.mark.slow
def test_importing_minifield_and_validating_does_not_import_jax():
    code = (
        "import sys, minifield\n"
        "assert 'minifield.api' not in sys.modules\n"
        "import minifield.recipe as r\n"
        "r.load('config/recipes/sft-demo.yaml')\n"
        "assert minifield.validate('config/recipes/sft-demo.yaml').valid\n"
        "assert minifield.validate('config/recipes/linear-demo.yaml').valid\n"
        "import minifield.strategies as s\n"
        "[x.describe() for x in s.available()]\n"
        "assert 'jax' not in sys.modules and 'optax' not in sys.modules, 'JAX was imported'\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr


@pytest.mark.slow
def test_validate_gives_the_worker_verdict(worker_reference):
    checked = minifield.validate(LINEAR_DEMO)
    assert checked.valid and checked.errors == []
    assert checked.to_json() == worker_reference["verdict"]


def test_validate_gives_the_digest_by_hand():
    checked = minifield.validate(LINEAR_DEMO)
    assert checked.valid and checked.strategy == {"name": "linear-momentum", "version": "1.0.0"}
    # By hand: the computation-defining fields of linear-demo.yaml with the strategy's
    # defaults spelled out, as sorted compact JSON.
    fields = {
        "strategy": {"name": "linear-momentum", "version": "1.0.0"},
        "inputs": [
            {
                "name": "examples",
                "sha256": "16472bf680cd60a778eac2f7c7e498e2a4a5fe1bc39a3249adb3674699613fb7",
            }
        ],
        "model": {"init_scale": 0.1},
        "training": {"seed": 3, "learning_rate": 0.04, "momentum": 0.8, "batch_size": 8},
        "limits": {"max_steps": 8},
        "evaluation": {"heldout_x": [-1.5, -0.37, 0.22, 1.5], "max_heldout_mse": 1.0},
    }
    text = json.dumps(fields, sort_keys=True, separators=(",", ":"))
    assert checked.computation_digest == hashlib.sha256(text.encode()).hexdigest()


@pytest.mark.slow
def test_validate_takes_a_dict_and_reports_every_problem_without_raising(tmp_path):
    bad = linear_recipe(limits={"max_steps": 10**30, "deadline": "tomorrow-ish"})
    checked = minifield.validate(bad)
    assert not checked.valid and checked.computation_digest is None
    assert {e["path"] for e in checked.errors} == {"/limits/max_steps", "/limits/deadline"}
    # the same verdict document as the worker prints for that recipe in a file
    proc = run_worker("--job", write_recipe(tmp_path / "bad.json", bad), "--validate-only")
    assert proc.returncode == 2
    assert json.loads(proc.stdout) == checked.to_json()


def test_validate_of_a_file_that_is_not_utf8_is_a_verdict(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_bytes(b"\xff\xfe")
    checked = minifield.validate(path)
    assert not checked.valid
    assert checked.errors[0]["path"] == "" and "UTF-8" in checked.errors[0]["message"]


@pytest.mark.slow
def test_run_gives_the_worker_result(worker_reference, tmp_path):
    result = minifield.run(LINEAR_DEMO, input_root=DATA, output_root=tmp_path, attempt_id="api1")
    reference = worker_reference["result"]
    assert (result.status, result.exit_code, result.ok) == ("completed", 0, True)
    assert result.attempt_dir == tmp_path / "linear-demo" / "api1"
    assert result.computation_digest == reference["computation_digest"]
    assert result.final_state_hash == reference["final_state_hash"]
    assert result.steps_completed == reference["steps_completed"] == 8
    assert result.metrics["heldout_mse"] == reference["metrics"]["heldout_mse"]
    # the fields come from the attempt's own result.json
    written = json.loads((result.attempt_dir / "result.json").read_text())
    assert result.result == written and result.checkpoint == written["checkpoint"]
    assert result.checkpoint["step"] == 8


@pytest.mark.slow
def test_stop_and_resume_through_the_api_reach_the_worker_hash(worker_reference, tmp_path):
    checked = minifield.validate(LINEAR_DEMO)
    first = minifield.run(checked, input_root=DATA, output_root=tmp_path, stop_after_step=3)
    assert (first.status, first.exit_code) == ("limit_reached", 4)
    assert first.checkpoint["step"] == 3 and first.final_state_hash is None
    resumed = minifield.run(
        checked, input_root=DATA, output_root=tmp_path, resume_from=first.attempt_dir
    )
    assert (resumed.status, resumed.exit_code) == ("completed", 0)
    assert resumed.final_state_hash == worker_reference["result"]["final_state_hash"]


@pytest.mark.parametrize(
    ("recipe", "arguments", "phase", "needle"),
    [
        (linear_recipe(limits={"max_steps": 10**30}), {}, "validate", "/limits/max_steps"),
        (linear_recipe(), {"input_root": "no-such-dir"}, "arguments", "--input-root"),
        (linear_recipe(), {"stop_after_step": 0}, "arguments", "--stop-after-step"),
        (linear_recipe(), {"resume_from": "no-such-attempt"}, "arguments", "--resume-from"),
    ],
)
def test_a_refused_run_is_a_result_and_writes_nothing(tmp_path, recipe, arguments, phase, needle):
    (tmp_path / "in").mkdir()
    out = tmp_path / "out"
    arguments = {"input_root": tmp_path / "in", "output_root": out, **arguments}
    result = minifield.run(recipe, **arguments)
    assert (result.status, result.exit_code, result.attempt_dir) == ("invalid", 2, None)
    assert result.error["phase"] == phase and needle in result.error["message"]
    assert not out.exists()


@pytest.mark.slow
def test_a_resume_of_another_computation_is_refused_like_the_worker(worker_reference, tmp_path):
    first = minifield.run(LINEAR_DEMO, input_root=DATA, output_root=tmp_path, stop_after_step=2)
    other = minifield.run(
        linear_recipe(job_id="linear-demo", training={"learning_rate": 0.05}),
        input_root=DATA,
        output_root=tmp_path,
        resume_from=first.attempt_dir,
    )
    # refused inside the new attempt, as the worker does: result.json says why, exit 2
    assert (other.status, other.exit_code, other.error["phase"]) == ("failed", 2, "resume")
    assert json.loads((other.attempt_dir / "result.json").read_text())["status"] == "failed"
    assert other.final_state_hash is None


def test_exit_codes_are_the_workers():
    from minifield import api
    from minifield.attempt import train

    assert (api.EXIT_COMPLETED, api.EXIT_FAILED, api.EXIT_INVALID) == (
        train.EXIT_COMPLETED,
        train.EXIT_FAILED,
        train.EXIT_INVALID,
    )
    assert (api.EXIT_PREEMPTED, api.EXIT_LIMIT) == (train.EXIT_PREEMPTED, train.EXIT_LIMIT)


@pytest.mark.slow
def test_the_readme_example_runs(tmp_path, worker_reference):
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Python API", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    script = tmp_path / "example.py"
    script.write_text(code)
    proc = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "out")],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
        env={**os.environ, **compiled_as(THIS_PROCESS)},  # as the worker reference
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"completed {worker_reference['result']['final_state_hash']}" in proc.stdout
