"""Only a worker opens the accelerator (minifield.supervision.accelerator).

On CPU, a parent is run with ``JAX_PLATFORMS`` naming an accelerator this machine lacks
(``conftest.ACCELERATOR_ABSENT``): any JAX backend it started other than the CPU's would fail
it, while ``MINIFIELD_WORKER_JAX_PLATFORMS=cpu`` gives its workers the CPU. Every Snakemake
run of the suite runs so (``conftest.run_snakemake``); here the contract's parts one by one.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from conftest import ACCELERATOR_ABSENT, REPO, linear_recipe, write_recipe

from minifield.supervision import accelerator


def test_keep_off_keeps_the_given_platforms_for_workers():
    env = {"JAX_PLATFORMS": "tpu"}
    accelerator.keep_off(env)
    assert env == {"JAX_PLATFORMS": "cpu", accelerator.WORKER_PLATFORMS: "tpu"}
    accelerator.keep_off(env)  # a parent's child that is a parent too: the original stays
    assert env[accelerator.WORKER_PLATFORMS] == "tpu"
    assert accelerator.worker_env(env) == {"JAX_PLATFORMS": "tpu"}


def test_a_parent_left_to_choose_gives_its_workers_the_choice():
    env = {"PATH": "/bin"}
    accelerator.keep_off(env)
    assert env["JAX_PLATFORMS"] == "cpu"
    assert accelerator.worker_env(env) == {"PATH": "/bin"}  # JAX chooses again in the worker


def test_workers_platforms_set_beforehand_win_and_plain_environments_pass_unchanged():
    env = {**ACCELERATOR_ABSENT}
    accelerator.keep_off(env)
    assert env["JAX_PLATFORMS"] == "cpu"
    assert accelerator.worker_env(env) == {"JAX_PLATFORMS": "cpu"}
    assert accelerator.worker_env({"JAX_PLATFORMS": "tpu"}) == {"JAX_PLATFORMS": "tpu"}


_PARENT = """
import sys
import jax.numpy as jnp
if sys.argv[1] == "keep_off":
    from minifield.supervision import accelerator
    accelerator.keep_off()
import jax
print(jax.default_backend(), float(jnp.ones(3).sum()))
"""


@pytest.mark.slow
def test_the_absent_accelerator_fails_a_process_that_does_not_keep_off():
    """The check's own evidence: the environment the suite gives its parents does fail a
    process that starts JAX as it pleases, and a process that keeps off computes on the CPU."""
    env = {**os.environ, **ACCELERATOR_ABSENT}
    runs = {
        how: subprocess.run(
            [sys.executable, "-c", _PARENT, how], env=env, capture_output=True, text=True
        )
        for how in ("as_it_pleases", "keep_off")
    }
    assert runs["as_it_pleases"].returncode != 0
    assert "Unable to initialize backend 'tpu'" in runs["as_it_pleases"].stderr
    assert runs["keep_off"].returncode == 0, runs["keep_off"].stderr[-2000:]
    assert runs["keep_off"].stdout.split() == ["cpu", "3.0"]


@pytest.mark.slow
def test_prove_cli_checks_checkpoints_on_the_cpu_and_its_workers_get_theirs(tmp_path):
    """The prover loads and hashes the faulted run's checkpoint itself; with the accelerator
    named and absent it passes only if that happens on the CPU, its workers on theirs."""
    recipe = write_recipe(tmp_path / "r.json", linear_recipe())
    proc = subprocess.run(
        [sys.executable, "-m", "minifield.cli", "prove", str(recipe), "--input-root"]
        + [str(REPO / "data"), "--work-dir", str(tmp_path / "w"), "--mode", "crash"]
        + ["--out", str(tmp_path / "proof.json")],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **ACCELERATOR_ABSENT},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    proof = json.loads((tmp_path / "proof.json").read_text())
    assert proof["passed"] is True and proof["checkpoint_used"]["verified"] is True
    for name in ("reference", "faulted", "resumed"):
        attempt = json.loads((tmp_path / proof[name]["attempt_dir"] / "attempt.json").read_text())
        assert attempt["environment"]["env"]["JAX_PLATFORMS"] == "cpu"
        assert attempt["environment"]["backend"] == "cpu"


@pytest.mark.slow
def test_the_pipeline_ran_with_the_accelerator_absent(linear_demo_run):
    """The session's linear demo pipeline (validate → … → evaluate → publish) completed under
    ``ACCELERATOR_ABSENT``: its worker was given the CPU, every other process kept off."""
    (computation,) = (linear_demo_run / "results" / "computations").iterdir()
    result = json.loads((computation / "train" / "result.json").read_text())
    assert result["status"] == "completed"
    attempt = json.loads((linear_demo_run / result["attempt_dir"] / "attempt.json").read_text())
    assert attempt["environment"]["env"]["JAX_PLATFORMS"] == "cpu"
    assert json.loads((computation / "qualification" / "proof.json").read_text())["passed"]
    assert (computation / "eval" / "metrics.json").is_file()
