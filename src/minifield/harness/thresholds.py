"""Acceptance thresholds on harness results: ``{"task/metric": value}`` each met by
``result >= value``. Read by the evaluate stage and again by the store's gate from the
artifact's evidence; imports neither lm-eval nor JAX."""

from __future__ import annotations

import math
from typing import Any


def checks(thresholds: dict[str, float], results: dict[str, dict[str, Any]]) -> list[dict]:
    """One acceptance check per threshold (the shape of a strategy's acceptance checks):
    ``name`` is ``harness:task/metric``; a missing or non-finite result fails."""
    out = []
    for key in sorted(thresholds):
        task, metric = key.split("/", 1)
        value = (results.get(task) or {}).get(metric)
        number = value if isinstance(value, (int, float)) and not isinstance(value, bool) else None
        passed = number is not None and math.isfinite(number) and number >= thresholds[key]
        out.append(
            {
                "name": f"harness:{key}",
                "value": value,
                "threshold": thresholds[key],
                "passed": bool(passed),
            }
        )
    return out
