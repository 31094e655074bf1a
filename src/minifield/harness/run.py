"""Harness tasks evaluated on an export, offline: what the evaluate stage records.

The tasks are the recipe's, already resolved (:func:`.tasks.resolve_all`); they are written to a
temporary directory that lm-eval's task manager reads alone (its built-in task index is not
loaded), and ``datasets`` reads their local files with the hub switched off and its cache in
that directory too, so nothing is left behind and nothing is fetched.
"""

from __future__ import annotations

import math
import os
import tempfile
from pathlib import Path

import yaml

#: the environment that keeps datasets, huggingface_hub and evaluate off the network
OFFLINE = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "HF_EVALUATE_OFFLINE": "1"}


def metric_values(task_results: dict) -> dict[str, float]:
    """lm-eval's ``{"acc,none": 0.5, "acc_stderr,none": ...}`` as ``{"acc": 0.5}``: finite
    numbers only, a filter other than ``none`` kept in the name (``exact_match,strict``)."""
    out = {}
    for key, value in task_results.items():
        if "," not in key or "_stderr" in key or isinstance(value, bool):
            continue
        if not isinstance(value, (int, float)) or not math.isfinite(value):
            continue
        metric, filter_name = key.split(",", 1)
        out[metric if filter_name == "none" else key] = float(value)
    return out


def evaluate(export_dir: Path, resolved: list[dict], harness: dict, batch_size: int) -> dict:
    """Run the resolved tasks on the export, in its declared dtype; ``{"results": {task:
    {metric: value}}, "samples": {task: n}, "settings": ..., "lm_eval_version": ...,
    "dtype": ...}``."""
    os.environ.update(OFFLINE)
    import lm_eval
    from lm_eval.tasks import TaskManager

    from . import model as harness_model

    lm = harness_model.MinifieldLM(
        path=str(export_dir), batch_size=batch_size, max_gen_toks=harness["max_gen_toks"]
    )
    with tempfile.TemporaryDirectory(prefix="minifield-harness-") as tmp:
        task_dir = Path(tmp) / "tasks"
        task_dir.mkdir()
        for document in resolved:
            kwargs = {**document["dataset_kwargs"], "cache_dir": str(Path(tmp) / "datasets")}
            text = yaml.safe_dump({**document, "dataset_kwargs": kwargs}, sort_keys=True)
            (task_dir / f"{document['task']}.yaml").write_text(text, encoding="utf-8")
        output = lm_eval.simple_evaluate(
            model=lm,
            tasks=[d["task"] for d in resolved],
            num_fewshot=harness.get("num_fewshot"),
            limit=harness.get("limit"),
            task_manager=TaskManager(include_path=str(task_dir), include_defaults=False),
            apply_chat_template=harness.get("chat_template", False),
            log_samples=False,
            bootstrap_iters=0,
            verbosity="WARNING",
        )
    names = [d["task"] for d in resolved]
    return {
        "results": {name: metric_values(output["results"].get(name, {})) for name in names},
        "samples": {
            name: int((output.get("n-samples") or {}).get(name, {}).get("effective", 0))
            for name in names
        },
        "settings": {
            key: harness.get(key)
            for key in ("num_fewshot", "limit", "max_gen_toks", "chat_template")
        },
        "lm_eval_version": lm_eval.__version__,
        # the compute dtype the tasks ran in: the export's declared one (docs/harness.md)
        "dtype": lm.loaded.dtype,
    }


def record(recipe: dict, resolved: list[dict], export_dir: Path) -> dict:
    """What the evaluate stage records of the recipe's harness tasks on ``export_dir``: the
    results, the pinned files they came from, and the acceptance checks of its thresholds."""
    from . import tasks, thresholds

    harness = tasks.section(recipe)
    evaluated = evaluate(export_dir, resolved, harness, recipe["evaluation"]["batch_size"])
    return {
        **evaluated,
        "tasks": tasks.pinned_sha256(recipe),
        "thresholds": harness["thresholds"],
        "checks": thresholds.checks(harness["thresholds"], evaluated["results"]),
    }
