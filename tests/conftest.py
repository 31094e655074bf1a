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
