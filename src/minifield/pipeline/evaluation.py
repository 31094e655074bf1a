"""The evaluate stage: every retained checkpoint scored on DEV, one selected on DEV, TEST
assessed for it only.

The checkpoint format imports JAX: it is imported inside the functions that need it.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from .. import atomic
from .. import recipe as recipes
from ..attempt.chain import committed_checkpoints
from ..harness import tasks as harness_tasks
from ..inputs import examples
from .errors import StageError


def _retained_checkpoints(attempt_dir: Path) -> list[Path]:
    """Committed checkpoints along the attempt chain, one per step (the newest attempt's wins)."""
    by_step: dict[int, Path] = {}
    for step, path in committed_checkpoints(attempt_dir):
        by_step.setdefault(step, path)
    return [by_step[s] for s in sorted(by_step)]


def _load_selected(path: Path, sha256: str, program, computation_digest: str):
    """The selected checkpoint's state, verified again, and still the one DEV scored."""
    from ..state import checkpoint

    state, _ = checkpoint.load(path, program.init_state(), computation_digest=computation_digest)
    if checkpoint.manifest_sha256(path) != sha256:
        raise StageError(f"{path} changed while it was being evaluated (manifest sha256)")
    return state


def _harness_tasks(recipe: dict, input_root: Path | None) -> list[dict] | None:
    """The recipe's harness tasks resolved from the input root (None: it has none)."""
    if harness_tasks.section(recipe) is None:
        return None
    if input_root is None:
        raise StageError("the recipe has evaluation.harness tasks: the input root is needed")
    try:
        return harness_tasks.resolve_pinned(recipe, input_root)
    except harness_tasks.HarnessTaskError as exc:
        raise StageError(str(exc)) from None


def evaluate(
    recipe_json: Path,
    train_result: Path,
    examples_dir: Path,
    out_metrics: Path,
    out_selected_export: Path | None = None,
    input_root: Path | None = None,
) -> dict:
    """Evaluate every retained checkpoint on DEV, select one on DEV, assess TEST for it only.

    One checkpoint's state is held at a time (loaded, scored, dropped); the selected one is
    loaded again for TEST. With ``out_selected_export``, the selected checkpoint's weights
    are exported there (the train stage exports the final ones). A recipe's
    ``evaluation.harness`` tasks (read from ``input_root``, checked before anything is
    evaluated) run on that export; their results and threshold checks join the metrics.
    """
    from ..state import checkpoint

    recipe = recipes.load(recipe_json)
    harness = _harness_tasks(recipe.data, input_root)
    result = atomic.read_json(train_result)
    arrays, _ = examples.load(examples_dir, recipe.examples_digest)
    program = recipe.strategy.build(recipe.data, arrays)
    rows = []
    for path in _retained_checkpoints(Path(result["attempt_dir"])):
        try:
            state, manifest = checkpoint.load(
                path, program.init_state(), computation_digest=recipe.computation_digest
            )
        except checkpoint.CheckpointError as exc:
            rows.append({"step": None, "path": str(path), "rejected": str(exc)})
            continue
        rows.append(
            {
                "step": manifest["step"],
                "path": str(path),
                "sha256": checkpoint.manifest_sha256(path),
                "state_hash": manifest["state_hash"],
                "dev": program.evaluate(state),
            }
        )
        del state  # before the next checkpoint is loaded
    scored = [r for r in rows if "dev" in r]
    if not scored:
        raise StageError(f"no verifiable checkpoint to evaluate for {result['attempt_dir']}")
    metric, mode = recipe.strategy.selection_metric
    sign = 1.0 if mode == "min" else -1.0
    # Best DEV score wins; among equals the later step (more training) wins.
    selected = min(scored, key=lambda r: (sign * r["dev"][metric], -r["step"]))
    state = _load_selected(
        Path(selected["path"]), selected["sha256"], program, recipe.computation_digest
    )
    test = program.evaluate_test(state)
    if out_selected_export is not None:
        if out_selected_export.exists():
            shutil.rmtree(out_selected_export)
        program.export(state, out_selected_export)
    acceptance = recipe.strategy.acceptance(recipe.data, {**selected["dev"], **test})
    harness_record = None
    if harness is not None:
        if out_selected_export is None:
            raise StageError("evaluation.harness runs on the selected export: give its directory")
        from ..harness import run as harness_run  # lm-eval: only for a recipe with harness tasks

        harness_record = harness_run.record(recipe.data, harness, out_selected_export)
        checks = acceptance["checks"] + harness_record["checks"]
        acceptance = {"passed": all(c["passed"] for c in checks), "checks": checks}
    metrics = {
        "computation_digest": recipe.computation_digest,
        "final_state_hash": result["final_state_hash"],
        "checkpoints": rows,
        "selection": {
            "split": "dev",
            "metric": metric,
            "mode": mode,
            "step": selected["step"],
            "sha256": selected["sha256"],
        },
        "selected_dev": selected["dev"],
        "test": test,
        "acceptance": acceptance,
    }
    if harness_record is not None:
        metrics["harness"] = harness_record
    atomic.write_json(out_metrics, metrics)
    return metrics
