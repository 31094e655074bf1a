"""A real worker trains with the execution options on, crashes, and resumes bit-identically."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import (
    read_events,
    run_worker,
    small_sft_inputs,
    small_sft_recipe,
    write_recipe,
)

pytestmark = pytest.mark.slow  # worker processes


def _attempts(out: Path) -> list[Path]:
    return sorted((out / "sft-options").iterdir(), key=lambda p: p.stat().st_mtime)


def _hashes(attempts) -> dict[int, str]:
    found = {}
    for attempt in attempts:
        for event in read_events(attempt / "events.jsonl"):
            if event["type"] == "update":
                found[event["step"]] = event["state_hash"]
    return found


def test_scan_remat_and_chunked_loss_resume_bit_identically(tmp_path):
    inputs = small_sft_inputs(tmp_path)
    recipe = small_sft_recipe(
        inputs["pins"],
        "sft-options",
        1,
        training={"remat": "dots_saveable", "loss_chunk_tokens": 48},
    )
    recipe["model"].update(n_layers=2, scan_layers=True)
    path = write_recipe(tmp_path / "recipe.json", recipe)

    def run(out, *extra, codes=(0,)):
        return run_worker(
            *extra,
            job=path,
            input_root=inputs["input_root"],
            output_root=out,
            compilation_cache=tmp_path / "jax-cache",
            record_state_hashes=True,
            check_codes=codes,
        )

    run(tmp_path / "reference")
    (reference,) = _attempts(tmp_path / "reference")
    expected = json.loads((reference / "result.json").read_text())["final_state_hash"]

    out = tmp_path / "crashed"
    run(out, "--fail-after-step", "3", codes=(1,))
    (crashed,) = _attempts(out)
    run(out, "--resume-from", crashed)
    attempts = _attempts(out)
    result = json.loads((attempts[-1] / "result.json").read_text())
    assert result["status"] == "completed" and result["final_state_hash"] == expected
    assert _hashes(attempts) == _hashes([reference])  # every update, before and after the crash
    assert len(_hashes([reference])) == 6
