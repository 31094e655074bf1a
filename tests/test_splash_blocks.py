"""benchmarks/splash_blocks.py's search, on made-up timings: each kernel's blocks on its own,
the rounds' plans, the best joined, the budget and the resume; the table it writes is what
``splash_table.SPLASH_BLOCKS`` looks up. The kernels themselves: one tiny run (slow tier)."""

from __future__ import annotations

import itertools
import json
import sys
import types

import pytest
from conftest import REPO

from minifield.models import splash_table

sys.path.insert(0, str(REPO / "benchmarks"))
import splash_blocks as sweep  # noqa: E402
import splash_search as search  # noqa: E402

sys.path.remove(str(REPO / "benchmarks"))

CANDIDATES = [256, 512, 1024, 2048]
#: a made-up cost, separable by field, whose minimum is known: each field's preferred size
PREFERRED = {
    "block_q": 1024,
    "block_kv": 2048,
    "block_kv_compute": 512,
    "block_q_dkv": 256,
    "block_kv_dkv": 1024,
    "block_kv_dkv_compute": 1024,
    "block_q_dq": 2048,
    "block_kv_dq": 512,
}


def cost(kernel: str, blocks: dict) -> float:
    fields = [name for name in search.KERNELS[kernel] if name]
    return sum(abs(blocks[name].bit_length() - PREFERRED[name].bit_length()) for name in fields)


def timed(plan) -> list[dict]:
    return [{"kernel": k, "blocks": b, "ms": 1.0 + cost(k, b)} for k, b in plan]


def test_the_first_round_moves_one_kernels_query_or_key_blocks_from_the_held_sizes():
    base = search.held(2048, 512)
    assert set(base.values()) == {512}
    plan = search.first_round(2048, base, CANDIDATES)
    for kernel, (q, kv, compute) in search.KERNELS.items():
        mine = [b for k, b in plan if k == kernel]
        assert len(mine) == 7  # 4 query blocks, 4 key blocks, the held sizes once
        for blocks in mine:
            moved = {name for name in blocks if blocks[name] != base[name]}
            assert moved in ({q}, {kv}, {kv, compute} - {None}, set())
            if kv in moved and compute:  # the compute block held, or lowered to the key's
                assert blocks[compute] == min(blocks[kv], 512)
    # a row of 1024 takes no block of 2048
    assert all(
        max(b.values()) <= 1024
        for _, b in search.first_round(1024, search.held(1024, 512), [256, 512, 1024])
    )


def test_two_rounds_find_the_minimum_of_a_separable_cost_as_a_brute_force_does():
    """On a cost that is a sum over fields, one field at a time from the held sizes, then
    the compute block below the fastest key block, reaches the brute-force minimum over
    every combination of the candidates (compute blocks dividing their key blocks)."""
    base = search.held(2048, 512)
    runs = timed(search.first_round(2048, base, CANDIDATES))
    runs += timed(search.second_round(2048, base, CANDIDATES, runs))
    best = search.joined(runs)
    for kernel, fields in search.KERNELS.items():
        fields = [f for f in fields if f]
        brute = min(
            (
                dict(zip(fields, sizes, strict=True))
                for sizes in itertools.product(CANDIDATES, repeat=len(fields))
                if len(fields) == 2 or sizes[1] % sizes[2] == 0
            ),
            key=lambda sizes: cost(kernel, {**base, **sizes}),
        )
        assert {f: best[f] for f in fields} == brute, kernel
    assert set(best) == set(splash_table.SPLASH_DEFAULT_BLOCKS)


def fake_shape(seconds: float, clock: list):
    def sweep_shape(args, seq_len, head_dim, interpret):
        clock[0] += seconds
        blocks = dict.fromkeys(splash_table.SPLASH_DEFAULT_BLOCKS, seq_len // 2)
        return {
            "seq_len": seq_len,
            "head_dim": head_dim,
            "complete": True,
            "best": {"blocks": blocks},
        }

    return sweep_shape


def test_the_budget_skips_a_shape_it_has_no_room_for_and_a_resume_keeps_what_was_done(
    monkeypatch,
):
    clock = [0.0]
    monkeypatch.setattr(sweep, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    monkeypatch.setattr(sweep, "sweep_shape", fake_shape(100.0, clock))
    args = types.SimpleNamespace(shapes=["2048x64", "2048x128", "4096x64"], budget_s=300.0)
    written = []
    first = sweep.sweep(args, True, None, written.append)
    # 100 s a shape: after two (200 s), 1.5 x 100 more would pass 300
    assert [s["complete"] for s in first["shapes"]] == [True, True, False]
    assert first["shapes"][2]["skipped"] == "budget" and len(written) == 2
    assert set(first["best"]) == {2048} and set(first["best"][2048]) == {64, 128}
    done = json.loads(json.dumps(first))  # as read back from the file
    clock[0] = 0.0
    monkeypatch.setattr(sweep, "sweep_shape", fake_shape(50.0, clock))
    second = sweep.sweep(args, True, done, None)
    assert [s["complete"] for s in second["shapes"]] == [True, True, True]
    assert clock[0] == 50.0  # only the shape the first run skipped
    assert second["best"][4096][64]["block_q"] == 2048


def test_the_best_is_the_table_the_lookup_reads(monkeypatch):
    clock = [0.0]
    monkeypatch.setattr(sweep, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    monkeypatch.setattr(sweep, "sweep_shape", fake_shape(1.0, clock))
    args = types.SimpleNamespace(shapes=["2048x64", "4096x128"], budget_s=300.0)
    best = json.loads(json.dumps(sweep.sweep(args, True)["best"]))
    table = {int(T): {int(K): b for K, b in w.items()} for T, w in best.items()}
    monkeypatch.setattr(splash_table, "SPLASH_BLOCKS", table)
    assert set(splash_table.splash_blocks(2048, head_dim=64).values()) == {1024}
    assert set(splash_table.splash_blocks(8192, head_dim=128).values()) == {2048}
    assert splash_table.splash_blocks(2048, head_dim=128) == splash_table.SPLASH_DEFAULT_BLOCKS


@pytest.mark.slow  # splash in Pallas's interpreter: one candidate, 4 compiles (5 s, 2 cores)
def test_the_tiny_sweep_runs_the_kernels_and_checks_them_against_the_xla_path(tmp_path):
    out = tmp_path / "sweep.json"
    argv = ["--tiny", "--shapes", "256x128", "--candidates", "128", "--out", str(out)]
    report = sweep.main(argv)
    assert json.loads(out.read_text())["best"] == {"256": {"128": report["best"][256][128]}}
    (shape,) = report["shapes"]
    assert shape["complete"] and shape["xla"]["ms"] > 0
    # BF16 inputs and outputs, FP32 products in the interpreter: the output and the q, k, v
    # gradients within BF16's rounding of the XLA path's (values below 8: BF16's spacing
    # there is at most 2^-5 = 0.031, so two roundings apart at most 0.0625)
    for run in shape["runs"]:
        assert run["max_abs_vs_xla"] <= 0.0625, run
    assert {r["kernel"] for r in shape["runs"]} == set(search.KERNELS)


class FakeShape:
    """A shape whose programs take made-up times: each kernel's blocks by :func:`cost`, a
    whole step by ``step_ms`` (blocks -> ms) so that the joined blocks can be made to lose."""

    def __init__(self, step_ms):
        self.rows, self.cfg, self.timed = 2, types.SimpleNamespace(n_heads=4), {}
        self.step_ms = step_ms

    def time_all(self, programs):
        for mode, blocks in programs:
            self.timed[sweep.key(mode, blocks)] = {"ms": self.step_ms(mode, blocks)}

    def ms(self, mode, blocks):
        return self.timed[sweep.key(mode, blocks)].get("ms")


@pytest.mark.parametrize("joined_wins", [True, False])
def test_the_table_takes_the_joined_blocks_only_where_they_beat_every_block_held(
    monkeypatch, joined_wins
):
    """Each kernel is swept with the others held, so its fastest joined may lose to all
    held (the chip's 2048 × 128: 6.37 ms joined, 5.50 all 512): the faster step is kept."""
    base = search.held(2048, 512)

    forward_fields = [f for f in search.KERNELS["forward"] if f]

    def step_ms(mode, blocks):
        if blocks is None:
            return 50.0  # the XLA path
        if mode == "forward":
            return 10.0 + cost("forward", blocks)
        if blocks == base:
            return 10.0
        if any(blocks[f] != base[f] for f in forward_fields):
            return 9.0 if joined_wins else 11.0  # only the joined step moves forward blocks
        return 10.0 + cost("dkv", blocks) + cost("dq", blocks)

    monkeypatch.setattr(sweep, "Shape", lambda *a: FakeShape(step_ms))
    args = types.SimpleNamespace(candidates=CANDIDATES, held=512)
    out = sweep.sweep_shape(args, 2048, 64, True)
    assert out["joined"]["ms"] == (9.0 if joined_wins else 11.0)
    assert out["best"]["blocks"] == (out["joined"]["blocks"] if joined_wins else base)
    assert out["best"]["from"] == ("joined" if joined_wins else "held")
    assert out["best"]["ms"] == min(9.0 if joined_wins else 11.0, 10.0)
