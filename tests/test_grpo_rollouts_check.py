"""benchmarks/grpo_rollouts.py's agreement check: both decode loops' greedy tokens in FP32 at
``HIGHEST`` must be equal before any speed figure is reported (tiny sizes, in process)."""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest
from conftest import REPO

sys.path.insert(0, str(REPO / "benchmarks"))
import grpo_rollouts  # noqa: E402

sys.path.remove(str(REPO / "benchmarks"))

TINY = ["--tiny", "--layers", "1", "--dtype", "float32"]


@pytest.mark.slow  # six compiles of the decode loops (12 s on 2 cores)
def test_the_loops_agree_in_fp32_and_only_then_are_timed(tmp_path):
    out = tmp_path / "rollouts.json"
    report = grpo_rollouts.main([*TINY, "--out", str(out)])
    assert report["agree"] is True
    check = report["fp32_highest"]
    assert check["tokens_equal"] == check["tokens"] == 4 * 8  # 2 prompts x G 2, 8 tokens
    written = json.loads(out.read_text())
    assert written["agree"] is True
    ratios = written["speed"]["minifield_over_minimal"]["wall"]
    speed = written["speed"]["wall_s"]
    assert ratios["min"] == pytest.approx(min(speed["minifield"]) / min(speed["minimal"]))


@pytest.mark.slow  # two compiles of the decode loops (2.3 s of the 3.12 fast tier)
def test_a_minimal_loop_that_decodes_otherwise_withholds_the_figures(tmp_path, monkeypatch):
    """A loop that computes something else (here: its greedy token shifted by one from the
    sixth on) fails the check: exit 1, ``agree`` false in the JSON, nothing timed."""
    real = grpo_rollouts.minimal_generate

    def otherwise(*args):
        tokens = np.array(real(*args))
        tokens[:, 5:] = (tokens[:, 5:] + 1) % 256
        return tokens

    monkeypatch.setattr(grpo_rollouts, "minimal_generate", otherwise)
    out = tmp_path / "rollouts.json"
    with pytest.raises(SystemExit, match="differ from minifield's in FP32"):
        grpo_rollouts.main([*TINY, "--out", str(out)])
    written = json.loads(out.read_text())
    assert written["agree"] is False and "speed" not in written
    assert written["fp32_highest"]["first_difference"] == [5, 5, 5, 5]
    assert written["fp32_highest"]["tokens_equal"] == 4 * 5
