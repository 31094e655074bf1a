"""The pipeline stages as plain functions: each Snakemake script calls exactly one of these.

validate → hash_inputs → prepare → train → evaluate. Each reads the files the
previous stage wrote and writes its own outputs atomically.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from . import atomic, checkpoint, examples, inputs, train
from . import recipe as recipes
from .digest import sha256_file


class StageError(Exception):
    pass


def validate(recipe_path: Path, out_recipe: Path, out_validation: Path) -> None:
    """Validated recipe (defaults filled) plus a validation record with both digests."""
    recipe = recipes.load(recipe_path)
    atomic.write_json(out_recipe, recipe.data)
    atomic.write_json(
        out_validation,
        {
            "valid": True,
            "source": str(recipe_path),
            "source_sha256": sha256_file(recipe_path),
            "computation_digest": recipe.computation_digest,
            "examples_digest": recipe.examples_digest,
            "strategy": {"name": recipe.strategy.name, "version": recipe.strategy.version},
        },
    )


def hash_inputs(recipe_json: Path, input_root: Path, out_inputs: Path) -> None:
    recipe = recipes.load(recipe_json)
    verified = inputs.verify(recipe.data, input_root)
    atomic.write_json(
        out_inputs,
        {
            "computation_digest": recipe.computation_digest,
            "input_root": str(input_root),
            "inputs": verified,
        },
    )


def prepare(recipe_json: Path, input_root: Path, out_dir: Path) -> dict:
    recipe = recipes.load(recipe_json)
    inputs.verify(recipe.data, input_root)
    arrays, meta = recipe.strategy.prepare(
        recipe.data, inputs.files_by_name(recipe.data, input_root)
    )
    return examples.write(out_dir, arrays, meta, recipe.examples_digest)


def latest_attempt(job_dir: Path) -> Path | None:
    """The most recently started attempt of a job (by its recorded start time)."""
    candidates = []
    if job_dir.is_dir():
        for entry in job_dir.iterdir():
            info = entry / train.ATTEMPT_FILE
            if info.is_file():
                candidates.append((atomic.read_json(info).get("started", ""), entry.name, entry))
    return max(candidates)[2] if candidates else None


def train_attempt(
    recipe_json: Path,
    input_root: Path,
    examples_dir: Path,
    work_dir: Path,
    out_result: Path,
    out_export: Path,
    log: Path,
    *,
    record_state_hashes: bool = True,
    allow_environment_change: bool = False,
) -> dict:
    """Run one worker attempt, resuming the computation's latest attempt if there is one.

    Attempts live under ``work_dir`` (not a declared output), so a failed job's
    checkpoints survive Snakemake's clean-up and the next try resumes from them.
    """
    recipe = recipes.load(recipe_json)
    job_dir = work_dir / "attempts" / recipe.job_id
    previous = latest_attempt(job_dir)
    attempt_id = train.new_attempt_id()
    command = [
        sys.executable,
        "-m",
        "minifield.worker",
        "--job",
        str(recipe_json),
        "--input-root",
        str(input_root),
        "--output-root",
        str(work_dir / "attempts"),
        "--examples",
        str(examples_dir),
        "--attempt-id",
        attempt_id,
        # Compiled executables persist across attempts: a resumed attempt starts updating sooner.
        "--compilation-cache",
        str(work_dir / "jax-cache"),
    ]
    if previous is not None:
        command += ["--resume-from", str(previous)]
    if record_state_hashes:
        command.append("--record-state-hashes")
    if allow_environment_change:
        command.append("--allow-environment-change")
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "a", encoding="utf-8") as handle:
        handle.write(f"$ {' '.join(command)}\n")
        handle.flush()
        code = subprocess.run(command, stdout=handle, stderr=handle, check=False).returncode
    attempt_dir = job_dir / attempt_id
    result_path = attempt_dir / train.RESULT_FILE
    if not result_path.is_file():
        raise StageError(
            f"training attempt {attempt_dir} exited {code} without a result.json; see {log}"
        )
    result = atomic.read_json(result_path)
    if code != 0 or result["status"] != "completed":
        error = result.get("error") or {}
        detail = f": {error.get('phase')}: {error.get('message')}" if error else ""
        advice = (
            "a retry cannot fix this: correct the recipe, inputs or environment first"
            if code == train.EXIT_INVALID
            else "the next run resumes from its last committed checkpoint"
        )
        raise StageError(
            f"training attempt {attempt_dir} ended {result['status']} (exit {code}){detail}; {advice}. Log: {log}"
        )
    if out_export.exists():
        shutil.rmtree(out_export)
    shutil.copytree(attempt_dir / "export", out_export)
    atomic.write_json(out_result, {**result, "attempt_dir": str(attempt_dir)})
    return result


def _retained_checkpoints(attempt_dir: Path) -> list[Path]:
    """Committed checkpoints along the attempt chain, one per step (the newest attempt's wins)."""
    by_step: dict[int, Path] = {}
    for directory in train._attempt_chain(attempt_dir):
        ckpt_dir = directory / "checkpoints"
        for step in checkpoint.committed_steps(ckpt_dir):
            by_step.setdefault(step, ckpt_dir / checkpoint.step_dir_name(step))
    return [by_step[s] for s in sorted(by_step)]


def evaluate(
    recipe_json: Path,
    train_result: Path,
    examples_dir: Path,
    out_metrics: Path,
    out_selected_export: Path | None = None,
) -> dict:
    """Evaluate every retained checkpoint on DEV, select one on DEV, assess TEST for it only.

    With ``out_selected_export``, the selected checkpoint's weights are exported there
    (the train stage exports the final ones).
    """
    recipe = recipes.load(recipe_json)
    result = atomic.read_json(train_result)
    arrays, _ = examples.load(examples_dir, recipe.examples_digest)
    program = recipe.strategy.build(recipe.data, arrays)
    rows, states = [], {}
    for path in _retained_checkpoints(Path(result["attempt_dir"])):
        try:
            state, manifest = checkpoint.load(
                path, program.init_state(), computation_digest=recipe.computation_digest
            )
        except checkpoint.CheckpointError as exc:
            rows.append({"step": None, "path": str(path), "rejected": str(exc)})
            continue
        step = manifest["step"]
        states[step] = state
        rows.append(
            {
                "step": step,
                "path": str(path),
                "sha256": checkpoint.manifest_sha256(path),
                "state_hash": manifest["state_hash"],
                "dev": program.evaluate(state),
            }
        )
    scored = [r for r in rows if "dev" in r]
    if not scored:
        raise StageError(f"no verifiable checkpoint to evaluate for {result['attempt_dir']}")
    metric, mode = recipe.strategy.selection_metric
    sign = 1.0 if mode == "min" else -1.0
    # Best DEV score wins; among equals the later step (more training) wins.
    selected = min(scored, key=lambda r: (sign * r["dev"][metric], -r["step"]))
    test = program.evaluate_test(states[selected["step"]])
    if out_selected_export is not None:
        if out_selected_export.exists():
            shutil.rmtree(out_selected_export)
        program.export(states[selected["step"]], out_selected_export)
    acceptance = recipe.strategy.acceptance(recipe.data, {**selected["dev"], **test})
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
    atomic.write_json(out_metrics, metrics)
    return metrics
