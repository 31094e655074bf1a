"""``minifield deliver``: deliver computations or single attempts to an MLflow tracking server.

    minifield deliver results/computations/<cdigest> [...]      # run, attempts, eval, artifacts
    minifield deliver --attempt-dir work/<cdigest>/attempts/<job>/<attempt>   # events only

Settings come from the ``tracking`` section of ``--config`` (``--uri``/``--experiment``
override it; delivery happens even when ``tracking.enabled`` is false there, because this
command is asked for explicitly). Delivery resumes from each attempt's cursor, so running it
again sends only what the server does not have yet.

Exit codes: 0 delivered; 1 the server stayed unavailable past the retry budget; 2 bad
request: unreadable input, unusable settings or credentials, or the server refused a request
(4xx), which sending it again cannot fix.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

EXIT_UNAVAILABLE, EXIT_BAD_REQUEST = 1, 2


def run(args) -> int:
    from ..inputs.credentials import CredentialsError
    from ..tracking import settings as tracking_settings
    from ..tracking.connection import DeliveryRefused, ServerUnavailable, TrackingError

    try:
        settings = tracking_settings.load(args.config)
        overrides = {
            key: value
            for key, value in (
                ("uri", args.uri),
                ("experiment", args.experiment),
                ("state_dir", args.state_dir),
                ("max_retry_wait_s", args.max_retry_wait),
            )
            if value is not None
        }
        settings = dataclasses.replace(settings, enabled=True, **overrides)
        tracking_settings.check(settings, str(args.config))
    except (tracking_settings.SettingsError, CredentialsError) as exc:
        print(f"minifield deliver: {exc}", file=sys.stderr)
        return EXIT_BAD_REQUEST
    if not args.computation and not args.attempt_dir:
        print(
            "minifield deliver: nothing to deliver: give COMPUTATION_DIR or --attempt-dir",
            file=sys.stderr,
        )
        return EXIT_BAD_REQUEST
    try:
        from ..tracking.computation import deliver_computation
        from ..tracking.connection import Connection
        from ..tracking.delivery import Delivery

        delivery = Delivery(Connection(settings))
        records = []
        for attempt_dir in args.attempt_dir:
            cursor = delivery.deliver_attempt(
                attempt_dir,
                batch_events=args.batch_events,
                on_batch=lambda c: print(
                    json.dumps({"attempt_id": c.attempt_id, "delivered_seq": c.delivered_seq}),
                    flush=True,
                ),
                fault_kill_after_send=args.fault_kill_after_send,
            )
            records.append(dataclasses.asdict(cursor))
        for computation_dir in args.computation:
            work_dir = args.work_dir or Path(_work_dir(args.config)) / computation_dir.name
            records.append(
                deliver_computation(delivery, computation_dir, work_dir, out_record=args.out)
            )
    except ImportError as exc:
        print(
            f"minifield deliver: the MLflow client is not installed ({exc}); install the "
            "`tracking` extra: uv sync --extra tracking",
            file=sys.stderr,
        )
        return EXIT_BAD_REQUEST
    except ServerUnavailable as exc:
        print(f"minifield deliver: {exc}; run it again to resume", file=sys.stderr)
        return EXIT_UNAVAILABLE
    except (DeliveryRefused, TrackingError, CredentialsError) as exc:
        print(f"minifield deliver: {exc}", file=sys.stderr)
        return EXIT_BAD_REQUEST
    except (OSError, ValueError, KeyError) as exc:
        print(f"minifield deliver: unreadable input: {exc}", file=sys.stderr)
        return EXIT_BAD_REQUEST
    if not args.attempt_dir:
        print(json.dumps(records, indent=2, sort_keys=True))
    return 0


def _work_dir(config: Path) -> str:
    import yaml

    try:
        document = yaml.safe_load(Path(config).read_text(encoding="utf-8")) or {}
    except (OSError, yaml.YAMLError):
        document = {}
    return (document.get("work_dir") if isinstance(document, dict) else None) or "work"


def register(sub) -> None:
    parser = sub.add_parser(
        "deliver",
        help="deliver computations or attempts to an MLflow tracking server (resumable)",
        description=(
            "Deliver runs to the MLflow tracking server of the config's tracking section: one "
            "run per computation, a nested run per attempt with every update's metrics at its "
            "training step, evaluation metrics and evidence artifacts. Resumes from persisted "
            "cursors; every metric point is delivered exactly once. Exit: 0 ok, 1 server "
            "unavailable, 2 bad request or refused by the server."
        ),
    )
    parser.add_argument(
        "computation",
        type=Path,
        nargs="*",
        metavar="COMPUTATION_DIR",
        help="results/computations/<cdigest> of a finished computation",
    )
    parser.add_argument("--attempt-dir", type=Path, action="append", default=[],
                        help="deliver only this attempt's events (repeatable)")  # fmt: skip
    parser.add_argument(
        "--work-dir",
        type=Path,
        help="the computation's work directory (default: <config work_dir>/<cdigest>)",
    )
    parser.add_argument("--config", type=Path, default=Path("config/config.yaml"))
    parser.add_argument("--uri", help="tracking server URI (overrides tracking.uri)")
    parser.add_argument("--experiment", help="experiment name (overrides tracking.experiment)")
    parser.add_argument("--state-dir", type=Path, help="delivery cursors and locks")
    parser.add_argument("--max-retry-wait", type=float, metavar="S",
                        help="give up after waiting S seconds for an unavailable server")  # fmt: skip
    parser.add_argument("--out", type=Path, help="write the delivery record (JSON) here")
    parser.add_argument("--batch-events", type=int, default=100, help=argparse_suppress())
    parser.add_argument("--fault-kill-after-send", type=int, help=argparse_suppress())
    parser.set_defaults(func=run)


def argparse_suppress():
    import argparse

    return argparse.SUPPRESS
