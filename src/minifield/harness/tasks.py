"""Pinned, offline harness tasks: a recipe's ``evaluation.harness.tasks`` checked against its
inputs, each task file read and refused when it could reach the network, then rewritten to
read its verified local dataset.

A task is ``{name, config, data}``: ``name`` is the task the YAML file defines (its ``task``
key), ``config`` and ``data`` name pinned recipe inputs (the task YAML and its dataset file), so
their sha256 are in the computation digest. The YAML must load a packaged ``datasets`` builder
that reads local files (``dataset_path: json``, ``parquet`` or ``csv``) with
``dataset_kwargs.data_files`` naming the data input's file (its name, relative to the YAML's
directory); it may not name a hub dataset, ``include`` other files, run code (``!function``) or
use a metric lm-eval would fetch from the hub. Importing this module imports neither lm-eval nor
JAX.
"""

from __future__ import annotations

from pathlib import Path
from typing import NoReturn

import yaml

#: datasets' packaged builders that read local files only
LOCAL_LOADERS = ("json", "parquet", "csv")
#: metrics lm-eval computes itself (any other name is fetched with ``evaluate.load``)
LOCAL_METRICS = (
    "acc",
    "acc_norm",
    "acc_mutual_info",
    "exact_match",
    "perplexity",
    "word_perplexity",
    "byte_perplexity",
    "bits_per_byte",
    "brier_score",
    "f1",
    "mcc",
)
#: keys of a task file that load other files or code
REFUSED_KEYS = ("include", "group", "tag", "dataset_name", "custom_dataset", "unsafe_code")


class HarnessTaskError(ValueError):
    """A harness task that cannot run offline from pinned files; names the task and field."""


def section(recipe: dict) -> dict | None:
    """The recipe's ``evaluation.harness`` section, None when it has none."""
    return recipe.get("evaluation", {}).get("harness")


def input_names(recipe: dict) -> list[str]:
    """The recipe inputs its harness tasks read (task files and datasets)."""
    harness = section(recipe) or {}
    return [t[key] for t in harness.get("tasks", []) for key in ("config", "data")]


def recipe_errors(recipe: dict) -> list[dict]:
    """Validation errors (JSON pointer + message) of the harness section against the recipe:
    every task's files pinned, task names unique, every threshold naming a task."""
    harness = section(recipe)
    if harness is None:
        return []
    pinned = {i["name"] for i in recipe.get("inputs", [])}
    errors, names = [], []
    for n, task in enumerate(harness["tasks"]):
        for key in ("config", "data"):
            if task[key] not in pinned:
                errors.append(
                    {
                        "path": f"/evaluation/harness/tasks/{n}/{key}",
                        "message": f"task {task['name']!r}: {key} {task[key]!r} is not a pinned "
                        "input of the recipe (name it in inputs with its sha256)",
                    }
                )
        if task["name"] in names:
            errors.append(
                {
                    "path": f"/evaluation/harness/tasks/{n}/name",
                    "message": f"task {task['name']!r} is listed twice",
                }
            )
        names.append(task["name"])
    for key in harness.get("thresholds", {}):
        task = key.split("/", 1)[0]
        if "/" not in key or task not in names:
            errors.append(
                {
                    "path": f"/evaluation/harness/thresholds/{key}",
                    "message": f"threshold {key!r}: expected 'task/metric' with a task of "
                    f"evaluation.harness.tasks ({names})",
                }
            )
    return errors


def _refuse(task: str, path: Path, field: str, expectation: str) -> NoReturn:
    raise HarnessTaskError(f"harness task {task!r}: {path}: {field}: {expectation}")


def _read_yaml(task: str, path: Path) -> dict:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        _refuse(task, path, "config", "the task file is missing")
    except (OSError, UnicodeDecodeError) as exc:
        _refuse(task, path, "config", f"cannot be read as UTF-8 text ({exc})")
    try:
        document = yaml.safe_load(text)
    except yaml.constructor.ConstructorError as exc:
        _refuse(
            task, path, "config", f"uses a YAML tag ({exc.problem}); code in task files is not run"
        )
    except yaml.YAMLError as exc:
        _refuse(task, path, "config", f"is not valid YAML ({str(exc).splitlines()[0]})")
    if not isinstance(document, dict):
        _refuse(task, path, "config", "expected a mapping (one task)")
    return document


def resolve(task: dict, files: dict[str, Path]) -> dict:
    """The task's YAML (``task["config"]``'s verified file) checked and rewritten to read the
    verified data file (``task["data"]``) by its absolute path; raises :class:`HarnessTaskError`.
    """
    name = task["name"]
    config_path, data_path = Path(files[task["config"]]), Path(files[task["data"]])
    document = _read_yaml(name, config_path)
    if document.get("task") != name:
        _refuse(
            name,
            config_path,
            "task",
            f"the file defines task {document.get('task')!r}, not {name!r} (unknown task)",
        )
    for key in REFUSED_KEYS:
        if document.get(key) is not None:
            _refuse(name, config_path, key, "not allowed: a task reads its one pinned dataset")
    loader = document.get("dataset_path")
    if loader not in LOCAL_LOADERS:
        _refuse(
            name,
            config_path,
            "dataset_path",
            f"{loader!r} would be fetched from the hub; "
            f"expected one of {list(LOCAL_LOADERS)} with a pinned local data file",
        )
    kwargs = document.get("dataset_kwargs") or {}
    data_files = kwargs.get("data_files") if isinstance(kwargs, dict) else None
    if not isinstance(data_files, dict) or not data_files or set(kwargs) != {"data_files"}:
        _refuse(
            name,
            config_path,
            "dataset_kwargs",
            "expected exactly {data_files: {split: file}} naming the pinned data file",
        )
    for split, where in data_files.items():
        if isinstance(where, str) and not (config_path.parent / where).is_file():
            _refuse(
                name,
                config_path,
                f"dataset_kwargs.data_files.{split}",
                f"the dataset file {where!r} is missing (expected the pinned input "
                f"{task['data']!r}, {data_path.name}, beside the task file)",
            )
        if (
            not isinstance(where, str)
            or (config_path.parent / where).resolve() != data_path.resolve()
        ):
            _refuse(
                name,
                config_path,
                f"dataset_kwargs.data_files.{split}",
                f"{where!r} is not the pinned data input {task['data']!r} ({data_path})",
            )
    if not data_path.is_file():
        _refuse(
            name, config_path, "dataset_kwargs.data_files", f"the dataset {data_path} is missing"
        )
    for n, metric in enumerate(document.get("metric_list") or []):
        metric_name = metric.get("metric") if isinstance(metric, dict) else None
        if metric_name not in LOCAL_METRICS:
            _refuse(
                name,
                config_path,
                f"metric_list[{n}].metric",
                f"{metric_name!r} is not computed locally; expected one of {list(LOCAL_METRICS)}",
            )
    resolved = dict(document)
    resolved["dataset_kwargs"] = {"data_files": {s: str(data_path.resolve()) for s in data_files}}
    return resolved


def resolve_all(recipe: dict, files: dict[str, Path]) -> list[dict]:
    """Every harness task of the recipe resolved (:func:`resolve`); [] without a section."""
    harness = section(recipe)
    return [] if harness is None else [resolve(t, files) for t in harness["tasks"]]


def resolve_pinned(recipe: dict, input_root: Path) -> list[dict]:
    """The recipe's harness tasks from its input root: every pinned input verified (sha256),
    then each task resolved; raises :class:`HarnessTaskError` naming the task and field (a
    missing or altered file names the input)."""
    from ..inputs import pinned
    from ..inputs.pinned import InputError

    if section(recipe) is None:
        return []
    try:
        pinned.verify(recipe, input_root)
        files = pinned.files_by_name(recipe, input_root)
    except InputError as exc:
        raise HarnessTaskError(f"harness tasks: {exc}") from None
    return resolve_all(recipe, files)


def pinned_sha256(recipe: dict) -> dict[str, dict[str, str]]:
    """``{task: {"config": sha256, "data": sha256}}``: the files each task was run from."""
    items = {i["name"]: i["sha256"] for i in recipe.get("inputs", [])}
    return {
        t["name"]: {"config": items[t["config"]], "data": items[t["data"]]}
        for t in (section(recipe) or {}).get("tasks", [])
    }
