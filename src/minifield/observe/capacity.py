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

:mod:`.capacity_scenarios` turns a real training run into capacity rows with this
arithmetic.
"""

from __future__ import annotations

import math
from decimal import Decimal, InvalidOperation
from fractions import Fraction
from numbers import Rational
from typing import Any

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
