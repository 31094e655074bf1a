"""Deliver one computation of the pipeline: its run, every attempt, evaluation and evidence.

What ``minifield deliver`` and the pipeline's ``deliver`` rule do, from the files a run
leaves (``results/computations/<cdigest>/`` and ``work/<cdigest>/attempts/``). Every part
is idempotent, so delivering again (after a failure, or after the live delivery already
sent the events) changes nothing that was delivered and adds what was not.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from .. import atomic
from .attempt_events import Point
from .delivery import Delivery
from .runs import fingerprint, recipe_params

#: evidence files of a computation directory, delivered as artifacts (path in the run)
ARTIFACTS = {
    "qualification/proof.json": "evidence",
    "eval/metrics.json": "evaluation",
    "summary.json": "summary",
    "validation.json": "recipe",
    "recipe.json": "recipe",
}
REPORT_PLOTS = "report"


def attempts_of(work_dir: Path, computation_digest: str) -> list[Path]:
    """Every attempt directory under ``work_dir/attempts`` of this computation, oldest first."""
    found = []
    for path in sorted(Path(work_dir, "attempts").glob("*/*/attempt.json")):
        try:
            attempt = atomic.read_json(path)
        except (OSError, ValueError):
            continue
        if attempt.get("computation_digest") == computation_digest:
            found.append((attempt.get("started") or "", path.parent))
    return [directory for _, directory in sorted(found)]


def provenance(computation_dir: Path) -> dict[str, Any]:
    validation = atomic.read_json(computation_dir / "validation.json")
    recipe = atomic.read_json(computation_dir / "recipe.json")
    result_path = computation_dir / "train" / "result.json"
    result = atomic.read_json(result_path) if result_path.is_file() else {}
    environment = result.get("environment") or {}
    return {
        "computation_digest": validation["computation_digest"],
        "examples_digest": validation.get("examples_digest"),
        "job_id": recipe.get("job_id"),
        "product": (recipe.get("product") or {}).get("name"),
        "code_hash": environment.get("code_hash"),
        "source_revision": environment.get("source_revision"),
        "environment_fingerprint": fingerprint(environment) if environment else None,
        "final_state_hash": result.get("final_state_hash"),
        "train_status": result.get("status"),
    }


def evaluation_points(metrics: dict[str, Any], timestamp: int) -> list[Point]:
    """``dev/<metric>`` at every evaluated checkpoint's step, ``test/<metric>``,
    ``harness/<task>/<metric>`` and ``selected_step`` at the DEV-selected step."""
    points = []
    for row in metrics.get("checkpoints") or []:
        for key, value in sorted((row.get("dev") or {}).items()):
            if _number(value) and isinstance(row.get("step"), int):
                points.append(Point(f"dev/{key}", float(value), timestamp, row["step"]))
    step = (metrics.get("selection") or {}).get("step")
    if isinstance(step, int):
        for key, value in sorted((metrics.get("test") or {}).items()):
            if _number(value):
                points.append(Point(f"test/{key}", float(value), timestamp, step))
        points.append(Point("selected_step", float(step), timestamp, step))
        # lm-evaluation-harness tasks on the selected export (MLflow names allow no comma)
        for task, values in sorted(((metrics.get("harness") or {}).get("results") or {}).items()):
            for key, value in sorted(values.items()):
                if _number(value):
                    name = f"harness/{task}/{key}".replace(",", ":")
                    points.append(Point(name, float(value), timestamp, step))
    return points


def _number(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def deliver_computation(
    delivery: Delivery, computation_dir: Path, work_dir: Path, out_record: Path | None = None
) -> dict[str, Any]:
    computation_dir = Path(computation_dir)
    recipe = atomic.read_json(computation_dir / "recipe.json")
    facts = provenance(computation_dir)
    params = recipe_params(recipe)
    run_id = delivery.computation_run(facts, params)
    attempts = []
    for attempt_dir in attempts_of(work_dir, facts["computation_digest"]):
        cursor = delivery.deliver_attempt(attempt_dir, params=params, provenance=facts)
        attempts.append(
            {
                "attempt_id": cursor.attempt_id,
                "run_id": cursor.run_id,
                "delivered_seq": cursor.delivered_seq,
                "finished": cursor.finished,
            }
        )
    metrics_path = computation_dir / "eval" / "metrics.json"
    evaluation = 0
    if metrics_path.is_file():
        stamp = int(metrics_path.stat().st_mtime * 1000)
        points = evaluation_points(atomic.read_json(metrics_path), stamp)
        evaluation = delivery.log_points_once(run_id, points)
    artifacts = []
    for relative, destination in ARTIFACTS.items():
        path = computation_dir / relative
        if path.is_file():
            delivery.connection.call(
                "log artifact", delivery.client.log_artifact, run_id, str(path), destination
            )
            artifacts.append(f"{destination}/{path.name}")
    for plot in sorted((computation_dir / REPORT_PLOTS).glob("*")):
        if plot.is_file():
            delivery.connection.call(
                "log artifact", delivery.client.log_artifact, run_id, str(plot), REPORT_PLOTS
            )
            artifacts.append(f"{REPORT_PLOTS}/{plot.name}")
    status = "FINISHED" if facts.get("train_status") == "completed" else "FAILED"
    delivery.connection.call("end run", delivery.client.set_terminated, run_id, status=status)
    record = {
        "tracking_uri": delivery.settings.uri,
        "experiment": delivery.settings.experiment,
        "computation_digest": facts["computation_digest"],
        "run_id": run_id,
        "attempts": attempts,
        "evaluation_points_sent": evaluation,
        "artifacts": artifacts,
        "delivered": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    if out_record is not None:
        atomic.write_json(out_record, record)
    return record
