"""Capacity and cost arithmetic from a measured job duration and assumed demand.

    offered worker-hours per hour = seconds_per_job × arrivals_per_hour / 3600
    nominal load per worker       = offered / workers
    minimum workers with reserve  = ceil(offered / (1 − reserve_fraction))
    hourly reserved budget        = workers × price_per_worker_hour
    active-time cost per job      = seconds_per_job / 3600 × price_per_worker_hour

All arithmetic is exact (``fractions.Fraction`` built from the *decimal text*
of each input), so a boundary such as an offered load of exactly 2.0 with no
reserve needs 2 workers, never 3 from a float that landed on 2.0000000000000004.
Floats appear only in the printed result.

Demand, worker count, reserve and price are assumptions, and the duration is a
local measurement: nothing here is a cloud price or an accelerator throughput.

The second half turns a real training run (its raw events) into capacity rows:
the measured job, plus what-if rows for a changed checkpoint cadence and a
changed workload duration, each derived from measured per-update and
per-checkpoint seconds (see :func:`scenarios`).
"""

from __future__ import annotations

import csv
import io
import math
from decimal import Decimal, InvalidOperation
from fractions import Fraction
from numbers import Rational
from pathlib import Path
from typing import Any

from .. import atomic
from . import summarize as summaries

SECONDS_PER_HOUR = 3600
BASIS_NOTE = (
    "seconds_per_job is local wall time measured on this machine; demand, workers, reserve "
    "and price are hypothetical assumptions. Not a cloud price, not an accelerator throughput."
)


class CapacityError(ValueError):
    """Invalid capacity input; the message names the field and what was expected."""


#: every input is 0 or between 1e-15 and 1e15 in magnitude: wide enough for any plan, and the
#: results (products and quotients of the inputs) stay far inside a float's range
MAX_MAGNITUDE = Decimal("1e15")
MIN_MAGNITUDE = Decimal("1e-15")
#: significant digits an input may carry (the exact arithmetic grows with them)
MAX_DIGITS = 50


def _in_range(name: str, value: Decimal, shown: Any) -> Decimal:
    """Refuse a value whose exact form would be huge (1e400, 1e-1000000000) before it is built."""
    if value.is_zero():
        return value
    if not MIN_MAGNITUDE <= abs(value) <= MAX_MAGNITUDE:
        raise CapacityError(
            f"{name}: must be 0 or between 1e-15 and 1e15 in magnitude, got {str(shown)[:40]}"
        )
    if len(value.as_tuple().digits) > MAX_DIGITS:
        raise CapacityError(
            f"{name}: at most {MAX_DIGITS} significant digits, got {str(shown)[:40]}"
        )
    return value


def exact(name: str, value: Any) -> Fraction:
    """An exact rational from decimal text, an int, a Decimal or a float (via its shortest repr).

    A float goes through ``repr`` so that 0.1 means the decimal 0.1 the user
    wrote, not the binary double nearest to it.
    """
    if isinstance(value, bool):
        raise CapacityError(f"{name}: expected a number, got a boolean {value!r}")
    if isinstance(value, Rational):
        fraction = Fraction(value)
        if fraction and not MIN_MAGNITUDE <= abs(fraction) <= MAX_MAGNITUDE:
            raise CapacityError(f"{name}: must be 0 or between 1e-15 and 1e15 in magnitude")
        return fraction
    if isinstance(value, float):
        if not math.isfinite(value):
            raise CapacityError(f"{name}: must be a finite number, got {value!r}")
        return Fraction(_in_range(name, Decimal(repr(value)), repr(value)))
    if isinstance(value, Decimal):
        if not value.is_finite():
            raise CapacityError(f"{name}: must be a finite number, got {value}")
        return Fraction(_in_range(name, value, value))
    if isinstance(value, str):
        text = value.strip()
        if text.lower().lstrip("+-") in ("nan", "inf", "infinity", "snan"):
            raise CapacityError(f"{name}: must be a finite number, got {value[:40]!r}")
        if "_" in text or "/" in text:
            raise CapacityError(
                f"{name}: expected a decimal number such as 2.5, got {value[:40]!r}"
            )
        try:
            # Decimal first: it holds 1e400 as digits and an exponent, where Fraction would
            # build the whole integer (for 1e-1000000000, effectively forever)
            decimal = Decimal(text)
        except InvalidOperation:
            raise CapacityError(
                f"{name}: expected a decimal number such as 2.5, got {value[:40]!r}"
            ) from None
        if not decimal.is_finite():
            raise CapacityError(f"{name}: must be a finite number, got {value[:40]!r}")
        return Fraction(_in_range(name, decimal, text))
    raise CapacityError(f"{name}: expected a number, got {type(value).__name__} {value!r}")


def _ceil(value: Fraction) -> int:
    return -((-value.numerator) // value.denominator)


def _number(value: Fraction) -> int | float:
    """JSON form: an int when integral, else the nearest float (display only)."""
    return int(value) if value.denominator == 1 else float(value)


def plan(
    seconds_per_job: Any,
    arrivals_per_hour: Any,
    workers: Any,
    reserve_fraction: Any,
    price_per_worker_hour: Any,
) -> dict:
    """The capacity figures for one set of inputs; raises CapacityError naming a bad input."""
    seconds = exact("seconds_per_job", seconds_per_job)
    arrivals = exact("arrivals_per_hour", arrivals_per_hour)
    worker_count = exact("workers", workers)
    reserve = exact("reserve_fraction", reserve_fraction)
    price = exact("price_per_worker_hour", price_per_worker_hour)
    if seconds <= 0:
        raise CapacityError(f"seconds_per_job: must be > 0 seconds, got {seconds_per_job!r}")
    if arrivals < 0:
        raise CapacityError(f"arrivals_per_hour: must be >= 0, got {arrivals_per_hour!r}")
    if worker_count.denominator != 1 or worker_count < 1:
        raise CapacityError(f"workers: must be a whole number >= 1, got {workers!r}")
    if not 0 <= reserve < 1:
        raise CapacityError(
            f"reserve_fraction: must satisfy 0 <= r < 1 (share of capacity kept idle), "
            f"got {reserve_fraction!r}"
        )
    if price < 0:
        raise CapacityError(f"price_per_worker_hour: must be >= 0, got {price_per_worker_hour!r}")

    offered = seconds * arrivals / SECONDS_PER_HOUR
    nominal = offered / worker_count
    min_workers = _ceil(offered / (1 - reserve))
    budget = worker_count * price
    cost_per_job = seconds / SECONDS_PER_HOUR * price
    return {
        "seconds_per_job": _number(seconds),
        "arrivals_per_hour": _number(arrivals),
        "workers": int(worker_count),
        "reserve_fraction": _number(reserve),
        "price_per_worker_hour": _number(price),
        "offered_worker_hours_per_hour": _number(offered),
        "nominal_load_per_worker": _number(nominal),
        "min_workers_with_reserve": min_workers,
        "configured_workers_meet_reserve": int(worker_count) >= min_workers,
        "hourly_reserved_budget": _number(budget),
        "active_cost_per_job": _number(cost_per_job),
        # The exact values, for anyone who needs more than a float's digits.
        "exact": {
            "offered_worker_hours_per_hour": str(offered),
            "nominal_load_per_worker": str(nominal),
            "hourly_reserved_budget": str(budget),
            "active_cost_per_job": str(cost_per_job),
        },
        "units": {
            "seconds_per_job": "s (measured locally)",
            "arrivals_per_hour": "jobs/h (hypothetical)",
            "offered_worker_hours_per_hour": "worker-h/h",
            "nominal_load_per_worker": "fraction of one worker's hour",
            "price_per_worker_hour": "currency/worker-h (hypothetical)",
            "hourly_reserved_budget": "currency/h (hypothetical)",
            "active_cost_per_job": "currency/job (hypothetical, active time only)",
        },
        "note": BASIS_NOTE,
    }


# -- from a real training run -----------------------------------------------------------------


def measure_run(result_json: Path, recipe: dict) -> dict:
    """Measured seconds of a training job, taken from its summary (:mod:`minifield.observe.summarize`:
    the one place that counts the raw events of every attempt it took).

    ``job_wall_s`` is the summary's ``attempts_wall_time_s``: per attempt, the
    monotonic span from its first to its last event, summed over attempts. The
    time between attempts (in the summary's ``job_wall_time_s``) is not counted:
    no worker is busy then. Process start-up before the first event is not
    included either (the rule's benchmark file has that). Update and checkpoint
    seconds are the sums of the ``seconds`` the worker measured for each; the
    rest is ``other_s`` (compile, restore, evaluation, export, and time lost in
    failed attempts).
    """
    result = atomic.read_json(result_json)
    if result.get("status") != "completed":
        raise CapacityError(f"{result_json}: status {result.get('status')!r}, expected completed")
    attempt_dir = result.get("attempt_dir")
    if not attempt_dir:
        raise CapacityError(
            f"{result_json}: no 'attempt_dir' (expected the pipeline's train/result.json)"
        )
    try:
        summary = summaries.summarize(summaries.attempt_event_files(Path(attempt_dir)))
    except summaries.SummaryError as exc:
        raise CapacityError(str(exc)) from None
    if summary["updates_count"] == 0:
        raise CapacityError(f"{result_json}: no update events in the attempt chain")
    attempts = [
        {
            "attempt_id": attempt["attempt_id"] or Path(attempt["events_file"]).parent.name,
            "wall_s": attempt["wall_s"],
            "updates": attempt["updates_count"],
            "update_s": attempt["update_s"],
            "checkpoint_commits": attempt["checkpoints_count"],
            "checkpoint_s": attempt["checkpoint_s"],
            "status": attempt["status"],
        }
        for attempt in summary["attempts"]
    ]
    wall = summary["attempts_wall_time_s"]
    updates, update_count = summary["update_time_s"], summary["updates_count"]
    checkpoints, commit_count = summary["checkpoint_s"], summary["committed_checkpoints_count"]
    environment = result.get("environment", {})
    return {
        "computation_digest": result["computation_digest"],
        "job_id": result["job_id"],
        "backend": environment.get("backend"),
        "device_kind": environment.get("device_kind"),
        "max_steps": recipe["limits"]["max_steps"],
        "checkpoint_every_steps": recipe["checkpoint"]["every_steps"],
        "attempts": attempts,
        "job_wall_s": wall,
        "wall_time_rule": "summary attempts_wall_time_s: sum of each attempt's first-to-last "
        "event span; time between attempts not counted",
        "updates": update_count,
        "update_s": updates,
        "mean_update_s": updates / update_count,
        "checkpoint_commits": commit_count,
        "checkpoint_s": checkpoints,
        "mean_checkpoint_s": checkpoints / commit_count if commit_count else 0.0,
        "other_s": wall - updates - checkpoints,
    }


def commits_for(max_steps: int, every_steps: int) -> int:
    """Checkpoints one uninterrupted run commits: every ``every_steps`` updates plus the final step."""
    return math.ceil(max_steps / every_steps)


def scenarios(measured: dict, cadences: list[int], step_factors: list[float]) -> list[dict]:
    """Measured job plus what-if durations.

    A what-if keeps the measured non-update, non-checkpoint time (``other_s``)
    and rebuilds the rest from measured means:
    ``other_s + steps × mean_update_s + commits(steps, cadence) × mean_checkpoint_s``.
    A changed cadence changes only the commit count; a changed workload scales
    the update count (ceil(max_steps × factor)) at the configured cadence. These
    are estimates from one local run, not measurements.
    """
    steps, every = measured["max_steps"], measured["checkpoint_every_steps"]

    def estimate(new_steps: int, new_every: int) -> float:
        return (
            measured["other_s"]
            + new_steps * measured["mean_update_s"]
            + commits_for(new_steps, new_every) * measured["mean_checkpoint_s"]
        )

    rows = [
        {
            "scenario": "measured",
            "description": f"measured job: {steps} updates, checkpoint every {every}",
            "max_steps": steps,
            "checkpoint_every_steps": every,
            "checkpoint_commits": measured["checkpoint_commits"],
            "seconds_per_job": measured["job_wall_s"],
            "seconds_basis": "measured (sum of attempt wall spans from events)",
        }
    ]
    for cadence in cadences:
        rows.append(
            {
                "scenario": f"checkpoint_every_{cadence}",
                "description": f"{steps} updates, checkpoint every {cadence} (was {every})",
                "max_steps": steps,
                "checkpoint_every_steps": cadence,
                "checkpoint_commits": commits_for(steps, cadence),
                "seconds_per_job": estimate(steps, cadence),
                "seconds_basis": "estimate from measured mean update and checkpoint seconds",
            }
        )
    for factor in step_factors:
        new_steps = math.ceil(steps * Fraction(repr(float(factor))))
        rows.append(
            {
                "scenario": f"workload_x{factor:g}",
                "description": f"{new_steps} updates ({factor:g}x), checkpoint every {every}",
                "max_steps": new_steps,
                "checkpoint_every_steps": every,
                "checkpoint_commits": commits_for(new_steps, every),
                "seconds_per_job": estimate(new_steps, every),
                "seconds_basis": "estimate from measured mean update and checkpoint seconds",
            }
        )
    return rows


def for_run(result_json: Path, recipe_json: Path, assumptions: dict, out_json: Path) -> dict:
    """capacity.json for one computation: measurements, assumptions and one plan per scenario."""
    recipe = atomic.read_json(recipe_json)
    measured = measure_run(result_json, recipe)
    rows = []
    for row in scenarios(
        measured,
        list(assumptions.get("checkpoint_every_steps", [])),
        list(assumptions.get("max_steps_factors", [])),
    ):
        figures = plan(
            repr(float(row["seconds_per_job"])),
            assumptions["arrivals_per_hour"],
            assumptions["workers"],
            assumptions["reserve_fraction"],
            assumptions["price_per_worker_hour"],
        )
        rows.append({**row, **{k: v for k, v in figures.items() if k not in ("note", "units")}})
    document = {
        "computation_digest": measured["computation_digest"],
        "job_id": measured["job_id"],
        "measured": measured,
        "assumptions": {
            **{
                k: assumptions[k]
                for k in (
                    "arrivals_per_hour",
                    "workers",
                    "reserve_fraction",
                    "price_per_worker_hour",
                )
            },
            "hypothetical": True,
        },
        "note": BASIS_NOTE
        + f" Measured on backend {measured['backend']!r} ({', '.join(measured['device_kind'] or [])}).",
        "rows": rows,
    }
    atomic.write_json(out_json, document)
    return document


CSV_COLUMNS = (
    "computation_digest",
    "job_id",
    "backend",
    "scenario",
    "description",
    "max_steps",
    "checkpoint_every_steps",
    "checkpoint_commits",
    "seconds_per_job",
    "seconds_basis",
    "arrivals_per_hour",
    "workers",
    "reserve_fraction",
    "price_per_worker_hour",
    "offered_worker_hours_per_hour",
    "nominal_load_per_worker",
    "min_workers_with_reserve",
    "configured_workers_meet_reserve",
    "hourly_reserved_budget",
    "active_cost_per_job",
    "assumptions",
)


def table(capacity_jsons: list[Path], out_csv: Path) -> int:
    """results/capacity.csv: every scenario row of every computation; returns the row count."""
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=CSV_COLUMNS, lineterminator="\n")
    writer.writeheader()
    count = 0
    for path in sorted(capacity_jsons):
        document = atomic.read_json(path)
        for row in document["rows"]:
            writer.writerow(
                {
                    **{k: row.get(k) for k in CSV_COLUMNS},
                    "computation_digest": document["computation_digest"],
                    "job_id": document["job_id"],
                    "backend": document["measured"]["backend"],
                    "assumptions": "hypothetical demand/workers/reserve/price; seconds measured "
                    f"locally on backend {document['measured']['backend']}",
                }
            )
            count += 1
    atomic.write_bytes(out_csv, buffer.getvalue().encode("utf-8"))
    return count
