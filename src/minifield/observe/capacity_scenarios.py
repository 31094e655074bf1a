"""Capacity rows from a real training run (its raw events): the measured job, plus what-if
rows for a changed checkpoint cadence and a changed workload duration, each derived from
measured per-update and per-checkpoint seconds (see :func:`scenarios`), and the table of
every computation's rows."""

from __future__ import annotations

import csv
import io
import math
from fractions import Fraction
from pathlib import Path

from .. import atomic
from . import summarize as summaries
from .capacity import BASIS_NOTE, CapacityError, plan


def measure_run(result_json: Path, recipe: dict) -> dict:
    """Measured seconds of a training job, taken from its summary
    (:mod:`minifield.observe.summarize`: the one place that counts the raw events of every
    attempt it took).

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
