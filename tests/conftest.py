"""Shared test helpers: the repository root, recipe writers, and running the real CLIs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def linear_recipe(**overrides) -> dict:
    """A minimal valid linear-momentum recipe (built-in 64 examples, no pinned inputs)."""
    recipe = {
        "job_id": "linear-test",
        "product": {"name": "line-fit", "version": "1.0"},
        "strategy": {"name": "linear-momentum", "version": "1.0.0"},
    }
    for key, value in overrides.items():
        recipe[key] = value
    return recipe


def write_recipe(path: Path, recipe: dict) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(recipe, indent=2))
    return path


def worker_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "minifield.worker", *map(str, args)]


def run_worker(*args, check_codes=None, timeout=300, env=None) -> subprocess.CompletedProcess:
    """Run ``minifield-worker`` as a real subprocess."""
    proc = subprocess.run(
        worker_command(*args),
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
        check=False,
    )
    if check_codes is not None and proc.returncode not in check_codes:
        raise AssertionError(
            f"worker exited {proc.returncode}, expected {check_codes}\nstdout:\n{proc.stdout[-3000:]}\n"
            f"stderr:\n{proc.stderr[-3000:]}"
        )
    return proc


def read_events(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.fixture
def repo() -> Path:
    return REPO


def snakemake_in(workdir: Path, *args: str, timeout: int = 900) -> subprocess.CompletedProcess:
    """Run the repository's workflow in ``workdir`` (a user's project directory)."""
    return subprocess.run(
        [sys.executable, "-m", "snakemake", "--snakefile", str(REPO / "Snakefile"),
         "--directory", str(workdir), "--cores", "2", *args],
        capture_output=True, text=True, timeout=timeout, check=False,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )  # fmt: skip


@pytest.fixture(scope="session")
def linear_demo_run(tmp_path_factory) -> Path:
    """The linear demo through the whole default pipeline, run once per test session.

    A template: tests that change anything work on their own copy (``copy_run``).
    """
    import shutil

    import yaml

    workdir = tmp_path_factory.mktemp("linear-demo-run")
    shutil.copytree(REPO / "data" / "linear", workdir / "data" / "linear")
    (workdir / "config" / "recipes").mkdir(parents=True)
    shutil.copy(REPO / "config" / "recipes" / "linear-demo.yaml", workdir / "config" / "recipes")
    config = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
    config["recipes"] = ["config/recipes/linear-demo.yaml"]
    (workdir / "config" / "config.yaml").write_text(yaml.safe_dump(config))
    proc = snakemake_in(workdir)
    assert proc.returncode == 0, proc.stderr[-5000:]
    return workdir


def copy_run(template: Path, destination: Path) -> Path:
    """A private copy of a finished project directory (results, work dir, Snakemake metadata)."""
    import shutil

    shutil.copytree(template, destination, symlinks=True)
    return destination
