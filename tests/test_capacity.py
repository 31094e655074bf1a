"""Capacity arithmetic against cases worked out by hand, input rejection, and a real run's rows."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from fractions import Fraction

import pytest

from minifield import cli
from minifield.observe import capacity

# (seconds_per_job, arrivals_per_hour, workers, reserve_fraction, price) -> figures by hand.
HAND_CASES = [
    # 3600 s × 2 /h = 7200 s/h = 2 worker-h/h exactly; no reserve → 2 workers, not 3.
    (
        ("3600", "2", "2", "0", "0.1"),
        {"offered": 2, "nominal": 1, "min_workers": 2, "budget": 0.2, "cost": 0.1},
    ),
    # 90 s × 30 /h = 2700 s/h = 0.75; 0.75 / (1 − 0.25) = 1 exactly → 1 worker.
    (
        ("90", "30", "1", "0.25", "4"),
        {"offered": 0.75, "nominal": 0.75, "min_workers": 1, "budget": 4, "cost": 0.1},
    ),
    # 100 s × 90 /h = 9000 s/h = 2.5; /4 workers = 0.625; 2.5 / 0.8 = 3.125 → 4;
    # budget 4 × 2.5 = 10; cost 100/3600 × 2.5 = 250/3600 = 5/72.
    (
        ("100", "90", "4", "0.2", "2.5"),
        {"offered": 2.5, "nominal": 0.625, "min_workers": 4, "budget": 10, "cost": 5 / 72},
    ),
    # No demand: nothing offered, no worker needed; the reserved budget is still paid.
    (
        ("60", "0", "3", "0.5", "1.5"),
        {"offered": 0, "nominal": 0, "min_workers": 0, "budget": 4.5, "cost": 60 / 3600 * 1.5},
    ),
]


@pytest.mark.parametrize(("inputs", "expected"), HAND_CASES)
def test_known_cases_worked_by_hand(inputs, expected):
    figures = capacity.plan(*inputs)
    assert figures["offered_worker_hours_per_hour"] == pytest.approx(expected["offered"])
    assert figures["nominal_load_per_worker"] == pytest.approx(expected["nominal"])
    assert figures["min_workers_with_reserve"] == expected["min_workers"]
    assert isinstance(figures["min_workers_with_reserve"], int)
    assert figures["hourly_reserved_budget"] == pytest.approx(expected["budget"])
    assert figures["active_cost_per_job"] == pytest.approx(expected["cost"])


@pytest.mark.parametrize(
    ("seconds", "arrivals", "reserve", "by_hand"),
    [
        # 0.2 s × 3600 /h = 720 s/h = 0.2 worker-h/h; 0.2 / (1 − 0.9) = 0.2 / 0.1 = 2.
        ("0.2", "3600", "0.9", 2),
        # 0.3 s × 1200 /h = 360 s/h = 0.1; 0.1 / 0.1 = 1 (the 0.1 + 0.2 family of traps).
        ("0.3", "1200", "0.9", 1),
        # 0.1 s × 7200 /h = 720 s/h = 0.2; 0.2 / 0.2 = 1.
        ("0.1", "7200", "0.8", 1),
    ],
)
def test_exact_boundaries_where_floats_overshoot(seconds, arrivals, reserve, by_hand):
    naive = math.ceil(float(seconds) * float(arrivals) / 3600 / (1 - float(reserve)))
    assert naive == by_hand + 1, "the case must really be a floating-point trap"
    assert (
        capacity.plan(seconds, arrivals, "1", reserve, "1")["min_workers_with_reserve"] == by_hand
    )
    # A float argument means the decimal the user wrote, so it lands on the boundary too.
    assert (
        capacity.plan(float(seconds), float(arrivals), 1, float(reserve), 1.0)[
            "min_workers_with_reserve"
        ]
        == by_hand
    )


@pytest.mark.slow
def test_cli_prints_one_json_object_with_inputs(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "minifield.cli", "capacity", "--seconds-per-job", "3600",
         "--arrivals-per-hour", "2", "--workers", "2", "--reserve-fraction", "0",
         "--price-per-worker-hour", "0.1"],
        capture_output=True, text=True, cwd=tmp_path, timeout=120, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    figures = json.loads(proc.stdout)
    assert figures["min_workers_with_reserve"] == 2
    assert figures["offered_worker_hours_per_hour"] == 2
    for key in ("seconds_per_job", "arrivals_per_hour", "workers", "reserve_fraction"):
        assert key in figures
    assert figures["price_per_worker_hour"] == 0.1
    assert "hypothetical" in figures["note"] and "Not a cloud price" in figures["note"]


@pytest.mark.slow
def test_cli_rejects_nan_in_a_real_process(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "minifield.cli", "capacity", "--seconds-per-job=nan",
         "--arrivals-per-hour", "2", "--workers", "2", "--reserve-fraction", "0",
         "--price-per-worker-hour", "1"],
        capture_output=True, text=True, cwd=tmp_path, timeout=120, check=False,
    )  # fmt: skip
    assert proc.returncode == 2
    assert "seconds_per_job" in proc.stderr and "finite" in proc.stderr
    assert proc.stdout == ""


GOOD = {
    "seconds-per-job": "10",
    "arrivals-per-hour": "5",
    "workers": "2",
    "reserve-fraction": "0.2",
    "price-per-worker-hour": "1",
}


@pytest.mark.parametrize(
    ("field", "value", "named"),
    [
        ("seconds-per-job", "nan", "seconds_per_job"),
        ("seconds-per-job", "inf", "seconds_per_job"),
        ("seconds-per-job", "-inf", "seconds_per_job"),
        ("seconds-per-job", "-5", "seconds_per_job"),
        ("seconds-per-job", "0", "seconds_per_job"),
        ("arrivals-per-hour", "-1", "arrivals_per_hour"),
        ("arrivals-per-hour", "NaN", "arrivals_per_hour"),
        ("workers", "0", "workers"),
        ("workers", "-2", "workers"),
        ("workers", "1.5", "workers"),
        ("reserve-fraction", "1", "reserve_fraction"),
        ("reserve-fraction", "1.5", "reserve_fraction"),
        ("reserve-fraction", "-0.1", "reserve_fraction"),
        ("price-per-worker-hour", "-0.01", "price_per_worker_hour"),
        ("price-per-worker-hour", "Infinity", "price_per_worker_hour"),
        ("price-per-worker-hour", "ten", "price_per_worker_hour"),
    ],
)
def test_cli_rejects_invalid_input_with_exit_2(field, value, named, capsys):
    argv = ["capacity"]
    for key, good in GOOD.items():
        argv.append(f"--{key}={value if key == field else good}")
    assert cli.main(argv) == 2
    captured = capsys.readouterr()
    assert named in captured.err
    assert captured.out == ""


# -- out-of-range arguments end in a refusal, never a traceback (issue 11, defect 2) -----------


@pytest.mark.slow
@pytest.mark.parametrize(
    ("seconds", "arrivals", "named"),
    [
        ("10", "1e400", "arrivals_per_hour"),  # used to end in an OverflowError traceback
        ("1e300", "1e300", "seconds_per_job"),
        ("1e-1000000000", "1", "seconds_per_job"),  # as an exact fraction: a 1e9-digit integer
        ("1e16", "1", "seconds_per_job"),
        ("1." + "1" * 60, "1", "seconds_per_job"),
    ],
)
def test_cli_refuses_out_of_range_numbers_without_a_traceback(tmp_path, seconds, arrivals, named):
    proc = subprocess.run(
        [sys.executable, "-m", "minifield.cli", "capacity", f"--seconds-per-job={seconds}",
         f"--arrivals-per-hour={arrivals}", "--workers", "2", "--reserve-fraction", "0",
         "--price-per-worker-hour", "1"],
        capture_output=True, text=True, cwd=tmp_path, timeout=120, check=False,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert named in proc.stderr and "Traceback" not in proc.stderr
    assert proc.stdout == "" and list(tmp_path.iterdir()) == []


def test_the_largest_inputs_still_give_finite_figures():
    figures = capacity.plan("1e15", "1e15", "1e15", "0.999999999999999", "1e15")
    # 1e15 s x 1e15 /h / 3600 s/h, over 1e-15 of capacity kept busy
    assert figures["offered_worker_hours_per_hour"] == pytest.approx(1e30 / 3600)
    assert figures["min_workers_with_reserve"] == math.ceil(
        Fraction(10**30, 3600) / Fraction(1, 10**15)
    )
    json.dumps(figures, allow_nan=False)


def test_an_unexpected_error_is_one_line_naming_the_arguments(monkeypatch, capsys):
    # No input is known to reach this guard (each command refuses bad input itself), so one
    # is injected: the guard must still print one line, name the arguments, exit 1.
    def broken(*_args):
        raise RuntimeError("something\nunforeseen")

    monkeypatch.setattr(capacity, "plan", broken)
    argv = ["capacity", *(f"--{k}={v}" for k, v in GOOD.items())]
    assert cli.main(argv) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert "RuntimeError: something unforeseen" in err and "--seconds-per-job=10" in err


# -- figures from a training run: the summary's, checked here against raw events by hand -------


def _events(path, rows, mono0, time0):
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = [
        json.dumps({"seq": i, "mono": mono0 + at, "time": time0 + at, **event})
        for i, (at, event) in enumerate(rows)
    ]
    path.write_text("\n".join(lines) + "\n")


def _update(step, seconds):
    return {"type": "update", "step": step, "examples": 8, "tokens": 0, "seconds": seconds}


def test_measured_run_across_a_restart_by_hand(tmp_path):
    # Attempt a1 (mono 10 -> 12, 2.0 s): updates 1, 2, commit 2, update 3, then killed.
    _events(tmp_path / "a1" / "events.jsonl", [
        (0.0, {"type": "attempt_started", "attempt_id": "a1"}),
        (0.5, {"type": "compiled", "seconds": 0.5}),
        (1.0, _update(1, 0.25)),
        (1.25, _update(2, 0.25)),
        (1.5, {"type": "checkpoint_committed", "step": 2, "seconds": 0.125}),
        (2.0, _update(3, 0.25)),
    ], mono0=10.0, time0=1000.0)  # fmt: skip
    # Attempt a2, 3.0 s later by the wall clock (mono 500 -> 503, 3.0 s): restores 2,
    # redoes 3, does 4, commits 4, completes.
    _events(tmp_path / "a2" / "events.jsonl", [
        (0.0, {"type": "attempt_started", "attempt_id": "a2"}),
        (0.5, {"type": "restored", "step": 2}),
        (1.0, _update(3, 0.25)),
        (1.25, _update(4, 0.25)),
        (1.5, {"type": "checkpoint_committed", "step": 4, "seconds": 0.125}),
        (3.0, {"type": "completed", "steps": 4}),
    ], mono0=500.0, time0=1005.0)  # fmt: skip
    (tmp_path / "a2" / "attempt.json").write_text(
        json.dumps({"resumed_from": str(tmp_path / "a1")})
    )
    result = tmp_path / "result.json"
    result.write_text(json.dumps({
        "status": "completed", "attempt_dir": str(tmp_path / "a2"), "computation_digest": "c",
        "job_id": "j", "environment": {"backend": "cpu", "device_kind": ["cpu"]},
    }))  # fmt: skip
    recipe = {"limits": {"max_steps": 4}, "checkpoint": {"every_steps": 2}}
    m = capacity.measure_run(result, recipe)
    # worker time: the spans 2.0 + 3.0; the 3.0 s between the attempts is not a worker's
    assert m["job_wall_s"] == pytest.approx(5.0)
    assert m["updates"] == 5 and m["update_s"] == pytest.approx(1.25)
    assert m["mean_update_s"] == pytest.approx(0.25)
    assert m["checkpoint_commits"] == 2 and m["checkpoint_s"] == pytest.approx(0.25)
    assert m["mean_checkpoint_s"] == pytest.approx(0.125)
    assert m["other_s"] == pytest.approx(5.0 - 1.25 - 0.25)
    assert [(a["attempt_id"], a["wall_s"], a["updates"], a["checkpoint_commits"], a["status"])
            for a in m["attempts"]] == [("a1", 2.0, 3, 1, "interrupted"),
                                        ("a2", 3.0, 2, 1, "completed")]  # fmt: skip
    rows = {r["scenario"]: r for r in capacity.scenarios(m, [1], [2])}
    assert rows["measured"]["seconds_per_job"] == pytest.approx(5.0)
    # 3.5 other + 4 updates x 0.25 + 4 commits x 0.125
    assert rows["checkpoint_every_1"]["seconds_per_job"] == pytest.approx(5.0)
    # 8 updates at cadence 2: 3.5 + 8 x 0.25 + 4 x 0.125
    assert rows["workload_x2"]["seconds_per_job"] == pytest.approx(6.0)
