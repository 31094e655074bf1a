"""Runs in MLflow: one run per computation, one nested run per training attempt.

- The **computation run** (tag ``minifield.kind=computation``) is found by its computation
  digest, so every delivery of a computation, from any process, lands in the same run. It
  holds the recipe's fields as params, the digests, code and environment as tags, the
  evaluation metrics and the evidence files as artifacts.
- Each **attempt run** (``minifield.kind=attempt``, ``mlflow.parentRunId`` = the computation
  run) holds that attempt's events (delivered by :mod:`.delivery`).

Run creation is find-or-create under a file lock in ``state_dir`` (so two delivering
processes cannot both create one); every write here is idempotent (tags overwrite, params
are written once, metric points are sent only when the run lacks them).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from typing import Any

from ..supervision import locks
from . import attempt_events
from .connection import Connection

KIND, COMPUTATION, ATTEMPT = "minifield.kind", "computation", "attempt"
MAX_METRICS_PER_CALL = 1000  # the tracking server's log_batch limits
MAX_TAGS_PER_CALL = 100
MAX_PARAMS_PER_CALL = 100
MAX_PARAM_CHARS = 6000
LOCK_WAIT_S = 600.0


class Runs:
    """The computation and attempt runs of one tracking server's experiment, and what is
    written to them."""

    def __init__(self, connection: Connection):
        self.connection = connection
        self.client = connection.client
        self.settings = connection.settings
        #: cursors and locks of this server and experiment (a new destination starts afresh)
        self.state_dir = self.settings.destination_state_dir
        self._experiment_id: str | None = None

    # -- experiment and runs ---------------------------------------------------------------
    def experiment_id(self) -> str:
        if self._experiment_id is None:
            name = self.settings.experiment
            found = self.connection.call("get experiment", self.client.get_experiment_by_name, name)
            if found is None:
                from .connection import DeliveryRefused

                try:
                    self._experiment_id = self.connection.call(
                        "create experiment", self.client.create_experiment, name
                    )
                except DeliveryRefused:  # another process created it meanwhile
                    found = self.connection.call(
                        "get experiment", self.client.get_experiment_by_name, name
                    )
                    if found is None:
                        raise
                    self._experiment_id = found.experiment_id
            else:
                self._experiment_id = found.experiment_id
        return self._experiment_id

    def _find_run(self, tags: dict[str, str]) -> str | None:
        condition = " and ".join(f"tags.`{key}` = '{value}'" for key, value in tags.items())
        runs = self.connection.call(
            "search runs",
            self.client.search_runs,
            [self.experiment_id()],
            filter_string=condition,
            max_results=2,
            order_by=["attributes.start_time ASC"],
        )
        return runs[0].info.run_id if runs else None

    def _find_or_create(self, identity: dict[str, str], tags: dict[str, str], name: str) -> str:
        lock = self.state_dir / "locks" / f"run-{'-'.join(identity.values())}.lock"
        lock.parent.mkdir(parents=True, exist_ok=True)
        with locks.held(lock, {"pid": os.getpid()}, timeout_s=LOCK_WAIT_S):
            run_id = self._find_run(identity)
            if run_id is None:
                run = self.connection.call(
                    "create run",
                    self.client.create_run,
                    self.experiment_id(),
                    tags={k: v[:MAX_PARAM_CHARS] for k, v in {**tags, **identity}.items()},
                    run_name=name,
                )
                run_id = run.info.run_id
        return run_id

    def computation_run(
        self, provenance: dict[str, Any], params: dict[str, str] | None = None
    ) -> str:
        """The computation's run (created on first use); ``provenance`` from :func:`provenance_of`."""
        digest = provenance["computation_digest"]
        tags = {f"minifield.{k}": str(v) for k, v in provenance.items() if v is not None}
        run_id = self._find_or_create(
            {KIND: COMPUTATION, "minifield.computation_digest": digest},
            tags,
            f"{provenance.get('job_id') or 'computation'} {digest[:16]}",
        )
        self.set_tags(run_id, tags)
        if params:
            self.log_missing_params(run_id, params)
        return run_id

    def attempt_run(self, parent_run_id: str, attempt: dict[str, Any]) -> str:
        environment = attempt.get("environment") or {}
        tags = {
            "mlflow.parentRunId": parent_run_id,
            "minifield.job_id": attempt.get("job_id"),
            "minifield.computation_digest": attempt["computation_digest"],
            "minifield.examples_digest": attempt.get("examples_digest"),
            "minifield.resumed_from": attempt.get("resumed_from") or "",
            "minifield.code_hash": environment.get("code_hash"),
            "minifield.source_revision": environment.get("source_revision"),
            "minifield.environment_fingerprint": fingerprint(environment),
        }
        tags = {k: str(v) for k, v in tags.items() if v is not None}
        return self._find_or_create(
            {KIND: ATTEMPT, "minifield.attempt_id": attempt["attempt_id"]},
            tags,
            f"attempt {attempt['attempt_id']}",
        )

    # -- small idempotent writes -----------------------------------------------------------
    def set_tags(self, run_id: str, tags: dict[str, str]) -> None:
        from mlflow.entities import RunTag

        items = [RunTag(k, v[:MAX_PARAM_CHARS]) for k, v in sorted(tags.items())]
        for start in range(0, len(items), MAX_TAGS_PER_CALL):
            chunk = items[start : start + MAX_TAGS_PER_CALL]
            self.connection.call("log tags", self.client.log_batch, run_id, tags=chunk)

    def log_missing_params(self, run_id: str, params: dict[str, str]) -> None:
        """Params are write-once in MLflow: log those the run lacks, leave the rest."""
        from mlflow.entities import Param

        existing = self.connection.call("get run", self.client.get_run, run_id).data.params
        missing = [
            Param(k, v[:MAX_PARAM_CHARS]) for k, v in sorted(params.items()) if k not in existing
        ]
        for start in range(0, len(missing), MAX_PARAMS_PER_CALL):
            chunk = missing[start : start + MAX_PARAMS_PER_CALL]
            self.connection.call("log params", self.client.log_batch, run_id, params=chunk)

    def log_points_once(self, run_id: str, points: Iterable[attempt_events.Point]) -> int:
        """Send the points the run does not hold yet (asks the server first); returns how many."""
        points = list(points)
        held = self.held_points(run_id, {p.key for p in points})
        missing = [p for p in points if p.identity() not in held]
        self.log_points(run_id, missing)
        return len(missing)

    def held_points(self, run_id: str, keys: Iterable[str]) -> set[tuple]:
        held: set[tuple] = set()
        for key in sorted(set(keys)):
            history = self.connection.call(
                "get metric history", self.client.get_metric_history, run_id, key
            )
            held.update((m.key, m.step, m.timestamp, m.value) for m in history)
        return held

    def log_points(
        self, run_id: str, points: list[attempt_events.Point], tags: dict[str, str] | None = None
    ) -> None:
        from mlflow.entities import Metric, RunTag

        metrics = [Metric(p.key, p.value, p.timestamp, p.step) for p in points]
        run_tags = [RunTag(k, v) for k, v in sorted((tags or {}).items())]
        if not metrics and not run_tags:
            return
        for start in range(0, max(len(metrics), 1), MAX_METRICS_PER_CALL):
            chunk = metrics[start : start + MAX_METRICS_PER_CALL]
            extra = run_tags if start == 0 else []
            self.connection.call(
                "log metrics", self.client.log_batch, run_id, metrics=chunk, tags=extra
            )


def fingerprint(environment: dict[str, Any]) -> str:
    """The attempt's environment fingerprint as one compact, sorted JSON text."""
    return json.dumps(environment, sort_keys=True, separators=(",", ":"))


def provenance_of(attempt: dict[str, Any]) -> dict[str, Any]:
    environment = attempt.get("environment") or {}
    return {
        "computation_digest": attempt["computation_digest"],
        "examples_digest": attempt.get("examples_digest"),
        "job_id": attempt.get("job_id"),
        "code_hash": environment.get("code_hash"),
        "source_revision": environment.get("source_revision"),
    }


def recipe_params(recipe: dict[str, Any]) -> dict[str, str]:
    """The recipe's fields flattened to ``a.b.c`` params (lists as compact JSON)."""
    params: dict[str, str] = {}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, dict):
            for key, item in value.items():
                walk(f"{prefix}.{key}" if prefix else str(key), item)
        elif isinstance(value, list):
            params[prefix] = json.dumps(value, sort_keys=True, separators=(",", ":"))
        else:
            params[prefix] = json.dumps(value) if not isinstance(value, str) else value

    walk("", recipe)
    return params
