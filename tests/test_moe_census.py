"""The MoE census (``benchmarks/moe_census.py``): an MoE layer's forward and backward kernels
summed by stage, the grouped products (on CPU an opaque stand-in for ``ragged_dot``) told apart.

Checked against arithmetic: the nine grouped products (three projections, forward, the rows'
gradient, the matrices') move exactly their operands and results, computed here from the
shapes; the FP32 experts stacked in the forward pass are read and written once at least; and
every stage of ``moe_mlp`` shows up."""

from __future__ import annotations

import json
import sys

import pytest
from conftest import REPO


@pytest.mark.slow  # compiles an MoE layer's forward and backward (1.8 s): the fast tier's 90 s
def test_the_tiny_census_counts_the_grouped_products_by_their_operands(tmp_path):
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import moe_census
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    out = tmp_path / "census.json"
    experts = 4
    argv = ["--tiny", "--experts", str(experts), "--programs", "ours", "--json", str(out)]
    assert moe_census.main(argv) == 0
    ours = json.loads(out.read_text())["ours"]
    rows, seq, D, F = moe_census.SHAPES["tiny"]
    E, M = experts, rows * seq * moe_census.TOP_K
    x, h = 2 * M * D, 2 * M * F  # BF16 rows of the input and the hidden width
    w, sizes = 2 * E * D * F, 4 * E  # one projection's BF16 matrices, the int32 group sizes
    forward = 2 * (x + w + sizes + 4 * M * F) + (h + w + sizes + 4 * M * D)
    rows_gradient = 2 * (h + w + sizes + 4 * M * D) + (x + w + sizes + 4 * M * F)
    matrices_gradient = 2 * (x + h + sizes + 4 * E * D * F) + (h + x + sizes + 4 * E * F * D)
    assert ours["products"]["bytes"] == forward + rows_gradient + matrices_gradient
    assert ours["products"]["flops"] == 9 * 2 * M * D * F
    assert ours["expert weights"]["bytes"] >= 2 * 4 * 3 * E * D * F  # the FP32 stack
    for stage in ("moe_router", "moe_gather", "moe_experts", "moe_scatter"):
        assert ours[stage]["bytes"] > 0, stage
