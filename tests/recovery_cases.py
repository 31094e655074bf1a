"""Strategies the recovery tests run over, and helpers to drive real worker processes.

Adding a strategy to every recovery test is one entry in ``CASES``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from conftest import linear_recipe, write_recipe


@dataclass(frozen=True)
class Case:
    name: str
    recipe: Callable[[], dict]  # a recipe with max_steps=steps, checkpoint every=every
    steps: int
    every: int
    kills: int = 10  # SIGKILL points per test run (the issue asks for at least 10)
    input_root: str = "data"  # relative to the repository root


CASES = [
    Case(
        "linear-momentum",
        lambda: linear_recipe(limits={"max_steps": 40}, checkpoint={"every_steps": 4, "keep": 3}),
        steps=40,
        every=4,
    ),
    # packed-sft: add Case("packed-sft", <recipe factory>, steps=..., every=...) here.
]


def attempt_options(recipe: Path, input_root: Path, out: Path, attempt: str) -> dict:
    """Worker options for one recorded attempt (``worker_command``/``run_worker`` keywords)."""
    return {
        "job": recipe,
        "input_root": input_root,
        "output_root": out,
        "attempt_id": attempt,
        "record_state_hashes": True,
    }


def events_of(attempt_dir: Path) -> list[dict]:
    """Events of an attempt, tolerating a torn last line (SIGKILL can cut a write)."""
    out = []
    for line in (attempt_dir / "events.jsonl").read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out


def update_hashes(attempt_dir: Path) -> dict[int, str]:
    return {e["step"]: e["state_hash"] for e in events_of(attempt_dir) if e["type"] == "update"}


def run_and_kill(command: list[str], should_kill: Callable[[dict], bool], env=None) -> dict:
    """Start a worker, watch its event stream, SIGKILL it the moment ``should_kill(event)``.

    Returns {returncode, killed_after (the event), events_seen}.
    """
    proc = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env={**os.environ, **(env or {})},
    )
    killed_after = None
    seen = []
    try:
        for line in proc.stdout:
            try:
                event = json.loads(line)
            except ValueError:
                continue
            seen.append(event)
            if killed_after is None and should_kill(event):
                os.kill(proc.pid, signal.SIGKILL)
                killed_after = event
                break
    finally:
        proc.stdout.close()
        code = proc.wait(timeout=300)
    return {"returncode": code, "killed_after": killed_after, "events_seen": seen}


def write_case_recipe(tmp: Path, case: Case, **changes) -> Path:
    recipe = case.recipe()
    for key, value in changes.items():
        recipe[key] = value
    return write_recipe(tmp / f"{case.name}.json", recipe)
