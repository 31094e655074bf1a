"""``linear-momentum`` 1.0.0: the small teacher workload for fast operational checks.

64 examples of y = 2x + 1 on evenly spaced x in [-1, 1]; a linear model fit by
SGD with momentum on minibatches sampled without replacement. The minibatch of
update ``n`` is a pure function of (seed, n), so a resumed run needs no replay.

The strategy (schema, checks, data, acceptance) imports no JAX; the compiled
program lives in :mod:`.program`, imported by ``build`` only; the teacher (its examples and
the held-out error) in :mod:`.teacher`, which both use.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from ...state import export
from ..base import Program, Strategy
from .teacher import N_EXAMPLES, heldout_mse, teacher_examples


class LinearMomentum(Strategy):
    name = "linear-momentum"
    version = "1.0.0"
    description = (
        "Linear model y = w*x + b fit to 64 examples of y = 2x + 1 by SGD with momentum "
        "on minibatches sampled without replacement (the fast operational teacher workload)."
    )
    default_max_steps = 8
    default_every_steps = 2
    selection_metric = ("heldout_mse", "min")

    def check(self, recipe: dict) -> list[dict]:
        errors = []
        names = [item["name"] for item in recipe.get("inputs", []) if isinstance(item, dict)]
        unknown = [n for n in names if n != "examples"]
        if unknown:
            errors.append(
                {
                    "path": "/inputs",
                    "message": f"linear-momentum accepts only an input named 'examples'; got {unknown}",
                }
            )
        return errors

    def data_spec(self, recipe: dict) -> dict:
        pinned = {i["name"]: i["sha256"] for i in recipe.get("inputs", [])}
        return {
            "strategy": self.name,
            "prepare_version": self.prepare_version,
            "examples": pinned.get("examples", "builtin:y=2x+1,n=64,linspace(-1,1)"),
        }

    def prepare(self, recipe: dict, files: dict[str, Path]) -> tuple[dict[str, np.ndarray], dict]:
        if "examples" not in files:
            return teacher_examples(), {"source": "builtin", "count": N_EXAMPLES}
        path = files["examples"]
        xs, ys = [], []
        with open(path, encoding="utf-8") as handle:
            for number, line in enumerate(handle, start=1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                    xs.append(float(row["x"]))
                    ys.append(float(row["y"]))
                except (ValueError, KeyError, TypeError) as exc:
                    raise ValueError(
                        f"{path}:{number}: expected a JSON object with numeric 'x' and 'y' ({exc})"
                    ) from exc
        batch = recipe["training"]["batch_size"]
        if len(xs) < batch:
            raise ValueError(
                f"{path}: {len(xs)} examples, fewer than training.batch_size={batch} "
                "(minibatches are sampled without replacement)"
            )
        arrays = {"x": np.asarray(xs, np.float32), "y": np.asarray(ys, np.float32)}
        return arrays, {"source": "examples", "count": len(xs)}

    def build(self, recipe: dict, examples: dict[str, np.ndarray]) -> Program:
        from .program import LinearProgram  # JAX: only when training

        return LinearProgram(recipe, examples)

    def acceptance(self, recipe: dict, metrics: dict[str, Any]) -> dict:
        threshold = recipe["evaluation"]["max_heldout_mse"]
        value = metrics.get("heldout_mse")
        passed = value is not None and np.isfinite(value) and value <= threshold
        check = {
            "name": "heldout_mse",
            "value": value,
            "threshold": threshold,
            "passed": bool(passed),
        }
        return {"passed": bool(passed), "checks": [check]}

    def evaluate_export(self, recipe: dict, export_dir: Path) -> dict[str, Any]:
        params, _ = export.read(export_dir)
        w = float(np.asarray(params["w"]).reshape(-1)[0])
        b = float(np.asarray(params["b"]).reshape(-1)[0])
        return {"heldout_mse": heldout_mse(w, b, recipe["evaluation"]["heldout_x"]), "w": w, "b": b}
