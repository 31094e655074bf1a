"""The check's summary: the issues' goals next to the measured values."""

from __future__ import annotations

from device_check.settings import NOT_APPLICABLE


def _get(sections: dict, name: str, *keys):
    value = sections.get(name)
    for key in keys:
        if not isinstance(value, dict):
            return None
        value = value.get(key)
    return value


def summary(sections: dict, tiny: bool) -> dict:
    """The issue's goals next to the measured values (``met``: None where not measured)."""

    def goal(value, target: str, ok) -> dict:
        return {"value": value, "goal": target, "met": None if value is None else bool(ok(value))}

    out = {
        "sections_ok": sorted(n for n, s in sections.items() if s.get("status") == "ok"),
        "sections_not_ok": sorted(
            n for n, s in sections.items() if s.get("status") not in ("ok", NOT_APPLICABLE)
        ),
        "tiny": tiny,
        "goals": {
            "mfu_350m": goal(
                _get(sections, "step_350m", "ours", "mfu"), ">= 0.45", lambda v: v >= 0.45
            ),
            "ours_over_minimal_125m": goal(
                _get(sections, "step_125m", "ours_over_minimal"), "<= 1.03", lambda v: v <= 1.03
            ),
            "ours_over_minimal_350m": goal(
                _get(sections, "step_350m", "ours_over_minimal"), "<= 1.03", lambda v: v <= 1.03
            ),
            "recovery_bit_exact": goal(
                _get(sections, "recovery", "bit_exact"), "true", lambda v: v is True
            ),
            "checkpoint_blocking_over_sync": goal(
                _get(sections, "checkpoint", "blocking_over_sync_time"),
                "<= 0.15",
                lambda v: v <= 0.15,
            ),
            "checkpoint_sync_over_raw_bandwidth": goal(
                _get(sections, "checkpoint", "sync_over_raw_bandwidth"),
                ">= 0.8",
                lambda v: v >= 0.8,
            ),
            # issue 55: a commit of a state still on the device, against the slower of its
            # floors (device -> host copy, raw write + fsync) measured in the same rounds
            "checkpoint_commit_over_floor": goal(
                _get(sections, "checkpoint", "commit_over_floor"), "<= 1.25", lambda v: v <= 1.25
            ),
        },  # fmt: skip
        "mfu_125m": _get(sections, "step_125m", "ours", "mfu"),
        "determinism_flags_cost": _get(sections, "determinism_cost", "deterministic_over_default"),
        "largest_rows": largest_rows(sections),
    }
    if _get(sections, "device", "expected_backend") == "tpu":
        out["tpu_goals"] = tpu_goals(sections, goal)
    if tiny:
        out["note"] = "tiny models on this backend: the goals are for the full sizes on a GPU"
    return out


def tpu_goals(sections: dict, goal) -> dict:
    """The chip's goals (issue 49, item 2): MFU against the BF16 matmul peak this run
    measured, as that issue takes it, and ours over the minimal loop."""

    def mfu(size: str):
        return _get(sections, f"step_{size}", "ours", "mfu_vs_measured_peak")

    return {
        "mfu_350m_vs_measured_peak": goal(mfu("350m"), ">= 0.45", lambda v: v >= 0.45),
        "mfu_125m_vs_measured_peak": goal(mfu("125m"), ">= 0.40", lambda v: v >= 0.40),
        "ours_over_minimal_350m": goal(
            _get(sections, "step_350m", "ours_over_minimal"), "<= 1.03", lambda v: v <= 1.03
        ),
    }


def largest_rows(sections: dict) -> dict | None:
    """The shapes section's answers: ``{model: {mode: rows}}`` (None where its search did not
    finish: the time ran out)."""
    models = _get(sections, "shapes", "models")
    if not isinstance(models, dict):
        return None
    return {
        name: {
            mode: (row.get("largest_rows") if row.get("complete") else None)
            for mode, row in model.items()
            if isinstance(row, dict) and "mode" in row
        }
        for name, model in models.items()
    }
