"""Quality as QLoRA claims it, on the Llama SFT demo (docs/quantized-base.md, "Quality"):
LoRA on the demo's pinned base held int8 and NF4 (double quantization) reaches the DEV loss
of LoRA on the BF16 base, same recipe, steps and seed (``benchmarks/qlora_quality.py``, the
figures' own code, run in process).

The runs must first learn: each DEV loss falls below a fifth of its untrained value and below
``ln(vocabulary)``, a uniform guess's, so that the ratios compare models that have learnt the
task, not three copies of the base. Then int8 within 1 % of BF16, and NF4 within 5 %: at this
budget the seed alone moves NF4 ÷ BF16 by several percent (0.99 to 1.04 over seeds 0-4, int8
÷ BF16 0.999 to 1.002), so the 2 % of the claim is a mean over seeds, which the docs record
(1.015 here, 1.016 at 200 updates); one seed cannot show it.
"""

from __future__ import annotations

import json
import math
import sys

import pytest
from conftest import REPO

pytestmark = pytest.mark.slow

STEPS = 80  # updates of 8 rows of 64 tokens: DEV loss from 10.2 to about 1.25


@pytest.fixture(scope="module")
def figures():
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import qlora_quality
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    return qlora_quality.compare(REPO / "data" / "llama-base", seeds=[0], steps=STEPS)


def test_lora_learns_the_demo_on_every_base(figures):
    vocabulary = json.loads((REPO / "data/llama-base/config.json").read_text())["vocab_size"]
    for name, run in figures["runs"].items():
        assert run["dev_loss"] < run["dev_loss_before"] / 5, name
        assert run["dev_loss"] < math.log(vocabulary), name


def test_int8_and_nf4_reach_the_bf16_base_dev_loss(figures):
    runs = figures["runs"]
    bf16 = runs["0/bf16"]["dev_loss"]
    assert abs(runs["0/int8"]["dev_loss"] / bf16 - 1) <= 0.01
    assert abs(runs["0/nf4"]["dev_loss"] / bf16 - 1) <= 0.05
