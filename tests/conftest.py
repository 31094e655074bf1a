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


def small_sft_inputs(root: Path, seed: int = 5, train: int = 96, held_out: int = 8) -> dict:
    """Write a small reversal dataset under ``root/in/sft``; returns its input root and pins."""
    import hashlib

    from minifield.strategies.packed_sft import sft_data

    data = root / "in" / "sft"
    data.mkdir(parents=True)
    sizes = {"train": train, "dev": held_out, "test": held_out}
    pins = {}
    for split, rows in sft_data.demo_examples(seed=seed, sizes=sizes).items():
        blob = sft_data.to_jsonl(rows)
        (data / f"{split}.jsonl").write_bytes(blob)
        pins[split] = hashlib.sha256(blob).hexdigest()
    return {"input_root": root / "in", "pins": pins}


def small_sft_recipe(pins: dict, job_id: str, devices: int, **sections) -> dict:
    """A tiny packed-sft recipe (d_model 32, one layer, batch 8) over ``small_sft_inputs``;
    ``sections`` replace ``limits``, ``checkpoint`` or ``evaluation`` or add ``training``
    keys via ``training=...``."""
    recipe = {
        "job_id": job_id,
        "product": {"name": "reverser", "version": "0"},
        "strategy": {"name": "packed-sft", "version": "12.0.0"},
        "inputs": [
            {"name": s, "path": f"sft/{s}.jsonl", "sha256": pins[s]}
            for s in ("train", "dev", "test")
        ],
        "model": {"d_model": 32, "n_layers": 1, "n_heads": 2, "d_ff": 64},
        "training": {
            "seq_len": 32,
            "batch_size": 8,
            "warmup_steps": 2,
            "learning_rate": 0.01,
            "data_parallel": {"devices": devices, "shard_params": False},
            **sections.pop("training", {}),
        },
        "limits": {"max_steps": 6},
        "checkpoint": {"every_steps": 2, "keep": 3},
        "evaluation": {"eval_every": 0, "batch_size": 8, "max_generate_examples": 2},
    }
    recipe.update(sections)
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
