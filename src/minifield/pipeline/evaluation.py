"""The evaluate stage: every retained checkpoint scored on DEV, one selected on DEV, TEST
assessed for it only (:mod:`.checkpoint_scores`), in this process or over several
(``evaluate.processes``, :mod:`.evaluation_processes`); then the acceptance checks and a
recipe's lm-eval harness tasks, here, on the selected export.
"""

from __future__ import annotations

from pathlib import Path

from .. import atomic
from .. import recipe as recipes
from ..harness import tasks as harness_tasks
from . import checkpoint_scores, evaluation_processes
from .errors import StageError


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
    *,
    processes: int = 1,
    log: Path | None = None,
    quantized_base_dir: Path | None = None,
    compilation_cache: Path | None = None,
) -> dict:
    """Evaluate every retained checkpoint on DEV, select one on DEV, assess TEST for it only.

    With ``out_selected_export``, the selected checkpoint's weights are exported there (the
    train stage exports the final ones). With ``processes`` above 1 the figures are computed
    by that many processes on the recipe's mesh (their output appended to ``log``). A
    recipe's ``evaluation.harness`` tasks (read from ``input_root``, checked before anything
    is evaluated) run here, once, on that export; their results and threshold checks join
    the metrics. ``quantized_base_dir``: the recipe's quantized base (the codes training
    ran on, made once by the prepare stage), read rather than made again.
    ``compilation_cache``: the computation's (its workers' cache,
    :func:`minifield.attempt.options.computation_cache`), given to evaluation processes: the
    programs the worker's final evaluation compiled are loaded, not compiled again (the
    accelerator's; this process compiles its own CPU programs as before).
    """
    recipe = recipes.load(recipe_json)
    harness = _harness_tasks(recipe.data, input_root)
    if harness is not None and out_selected_export is None:
        raise StageError("evaluation.harness runs on the selected export: give its directory")
    if processes == 1 and not evaluation_processes.opens_accelerator(recipe):
        scores = checkpoint_scores.score(
            recipe, train_result, examples_dir, out_selected_export,
            quantized_base_dir=quantized_base_dir,
        )  # fmt: skip
    else:
        scores = evaluation_processes.run(
            recipe, recipe_json, train_result, examples_dir, out_selected_export, processes,
            scratch=out_metrics.parent, log=log, quantized_base_dir=quantized_base_dir,
            compilation_cache=compilation_cache,
        )  # fmt: skip
    dev, test = scores["selected_dev"], scores["test"]
    acceptance = recipe.strategy.acceptance(recipe.data, {**dev, **test})
    harness_record = None
    if harness is not None:
        from ..harness import run as harness_run  # lm-eval: only for a recipe with harness tasks

        harness_record = harness_run.record(recipe.data, harness, out_selected_export)
        checks = acceptance["checks"] + harness_record["checks"]
        acceptance = {"passed": all(c["passed"] for c in checks), "checks": checks}
    metrics = {
        "computation_digest": recipe.computation_digest,
        "final_state_hash": atomic.read_json(train_result)["final_state_hash"],
        **scores,
        "acceptance": acceptance,
    }
    if harness_record is not None:
        metrics["harness"] = harness_record
    atomic.write_json(out_metrics, metrics)
    return metrics
