"""A real worker trains with the execution options on, crashes, and resumes bit-identically."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import (
    attempts_of,
    run_attempt,
    small_sft_inputs,
    small_sft_recipe,
    update_hashes,
    write_recipe,
)

pytestmark = pytest.mark.slow  # worker processes


def _attempts(out: Path) -> list[Path]:
    return attempts_of(out, "sft-options")


def test_scan_remat_and_chunked_loss_resume_bit_identically(tmp_path):
    inputs = small_sft_inputs(tmp_path)
    recipe = small_sft_recipe(
        inputs["pins"],
        "sft-options",
        1,
        training={"remat": "dots_saveable", "loss_chunk_tokens": 48},
    )
    recipe["model"].update(n_layers=2, scan_layers=True)
    # what is checked is every update's state hash: no greedy decoding in the final
    # evaluations (each completed worker decoded the DEV prompts for nothing checked here)
    recipe["evaluation"]["max_generate_examples"] = 0
    path = write_recipe(tmp_path / "recipe.json", recipe)

    def run(out, *extra, codes=(0,)):
        cache = tmp_path / "jax-cache"
        return run_attempt(path, inputs["input_root"], out, *extra, codes=codes, cache=cache)

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
    assert update_hashes(attempts) == update_hashes(
        [reference]
    )  # every update, before and after the crash
    assert len(update_hashes([reference])) == 6
