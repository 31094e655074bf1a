"""``minifield summarize EVENTS_JSONL [...]``: measured signals of a job from raw events."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from ..observe import summarize as summaries


def run(args) -> int:
    try:
        files = list(args.events)
        if args.attempt_dir is not None:
            files = summaries.attempt_event_files(args.attempt_dir) + files
        summary = summaries.summarize(files)
    except summaries.SummaryError as exc:
        print(f"minifield summarize: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(summary, indent=2, sort_keys=True, allow_nan=False))
    return 0


def register(sub) -> None:
    parser = sub.add_parser(
        "summarize",
        help="summarize a job's events: throughput, duty fraction, goodput, restart losses",
        description=(
            "Summarize the events.jsonl files of one job's attempts, oldest first. Every field "
            "name carries its unit (_s, _per_s, _fraction, _count). update_duty_fraction is "
            "update time over job wall time, not hardware utilization."
        ),
    )
    parser.add_argument(
        "events", type=Path, nargs="*", help="events.jsonl of each attempt, oldest first"
    )
    parser.add_argument(
        "--attempt-dir",
        type=Path,
        help="an attempt directory: use its events and those of the attempts it resumed from",
    )
    parser.set_defaults(func=run)
