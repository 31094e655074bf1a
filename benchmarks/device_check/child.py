"""A section's own process: run one section, write its result (partial ones on the way) for
the parent to read."""

from __future__ import annotations

import importlib
import json
import traceback
from pathlib import Path

from device_check.common import log, write_json

#: section -> (module, function): each runs in a process of its own,
#: ``function(args, context, report) -> dict``; ``report(dict)`` records partial results (a
#: timeout keeps them); ``context`` holds the earlier sections' results
SECTION_FUNCTIONS = {
    "device": ("section_device", "run"),
    "step_125m": ("section_steps", "step_125m"),
    "step_350m": ("section_steps", "step_350m"),
    "recovery": ("section_recovery", "run"),
    "checkpoint": ("section_checkpoint", "run"),
    "shapes": ("section_shapes", "run"),
    "determinism_cost": ("section_steps", "determinism_cost"),
}


def run_section_child(args) -> int:
    """In the child: run one section, write its result (partial ones on the way)."""
    out_path = Path(args.section_out)
    context = json.loads(Path(args.context).read_text()) if args.context else {}

    def report(partial: dict) -> None:
        write_json(out_path, {"status": "running", **partial})

    partial: dict = {}

    def keep(value: dict) -> None:
        partial.clear()
        partial.update(value)
        report(value)

    try:
        module, function = SECTION_FUNCTIONS[args.section]
        run = getattr(importlib.import_module(f"device_check.{module}"), function)
        result = run(args, context, keep)
    except Exception as exc:  # recorded, not raised: the parent reads the file
        write_json(
            out_path,
            {
                **partial,
                "status": "failed",
                "error": f"{type(exc).__name__}: {exc}",
                "traceback": traceback.format_exc()[-4000:],
            },
        )
        log(f"section {args.section} failed: {type(exc).__name__}: {exc}")
        return 1
    write_json(out_path, {**result, "status": "ok"})
    return 0
