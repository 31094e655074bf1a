"""``minifield capacity``: offered load, workers with reserve and hypothetical cost, as JSON."""

from __future__ import annotations

import json
import sys

from ..observe import capacity


def run(args) -> int:
    try:
        figures = capacity.plan(
            args.seconds_per_job,
            args.arrivals_per_hour,
            args.workers,
            args.reserve_fraction,
            args.price_per_worker_hour,
        )
    except capacity.CapacityError as exc:
        print(f"minifield capacity: invalid input: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(figures, indent=2, sort_keys=True))
    return 0


def register(sub) -> None:
    parser = sub.add_parser(
        "capacity",
        help="capacity plan from a measured job duration and hypothetical demand and price",
        description=(
            "Offered worker-hours per hour, nominal load per worker, minimum workers with a "
            "reserve fraction, hourly reserved budget and active-time cost per job. Exact "
            "decimal arithmetic; invalid input exits 2. " + capacity.BASIS_NOTE
        ),
    )
    # Values stay strings so the arithmetic can start from the exact decimal the user wrote.
    parser.add_argument("--seconds-per-job", required=True, metavar="S", help="> 0, measured")
    parser.add_argument("--arrivals-per-hour", required=True, metavar="A", help=">= 0")
    parser.add_argument("--workers", required=True, metavar="W", help="whole number >= 1")
    parser.add_argument("--reserve-fraction", required=True, metavar="R", help="0 <= R < 1")
    parser.add_argument("--price-per-worker-hour", required=True, metavar="P", help=">= 0")
    parser.set_defaults(func=run)
