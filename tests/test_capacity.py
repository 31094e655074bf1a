"""Capacity arithmetic against cases worked out by hand, input rejection, and a real run's rows."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from minifield import capacity, cli

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
