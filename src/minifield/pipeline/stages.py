"""The pipeline stages as plain functions: each Snakemake script calls exactly one of these.

validate → hash_inputs → prepare → qualify → train → evaluate. Each reads the files the
previous stage wrote and writes its own outputs atomically.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from collections.abc import Callable, Mapping
from pathlib import Path

from .. import atomic
from .. import recipe as recipes
from ..attempt.chain import newest_first
from ..attempt.layout import ATTEMPT_JSON, CHECKPOINTS, EXPORT, RESULT
from ..digest import sha256_file
from ..inputs import examples, pinned
from ..proof import recovery
from ..supervision import leases, locks, supervise

# checkpoint and train import JAX: they are imported in the stages that need them, so that
# the validate, hash_inputs and prepare jobs start without JAX.


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
    verified = pinned.verify(recipe.data, input_root)
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
    pinned.verify(recipe.data, input_root)
    arrays, meta = recipe.strategy.prepare(
        recipe.data, pinned.files_by_name(recipe.data, input_root)
    )
    return examples.write(out_dir, arrays, meta, recipe.examples_digest)


def latest_attempt(job_dir: Path) -> Path | None:
    """The most recently started attempt of a job (by its recorded start time)."""
    candidates = []
    if job_dir.is_dir():
        for entry in job_dir.iterdir():
            info = entry / ATTEMPT_JSON
            if info.is_file():
                candidates.append((atomic.read_json(info).get("started", ""), entry.name, entry))
    return max(candidates)[2] if candidates else None


def _worker_env(
    recipe: recipes.Recipe, held: leases.Lease, base: Mapping[str, str] | None
) -> dict[str, str]:
    env = held.env(os.environ if base is None else base)
    if recipe.data.get("runtime", {}).get("backend") == "cpu":
        # A CPU recipe on a GPU host must not grab (or wait for) a GPU.
        env["JAX_PLATFORMS"] = "cpu"
    return env


def _lease_gpus(recipe: recipes.Recipe, gpus: list | None) -> list[str]:
    if recipe.data.get("runtime", {}).get("backend") in ("cpu", "tpu"):
        return []
    return leases.visible_gpus(gpus)


def _append_run_to_log(log: Path, outcome: dict) -> None:
    with open(log, "a", encoding="utf-8") as handle:
        stderr_log = Path(outcome.get("stderr_log") or "")
        if stderr_log.is_file():
            handle.write(stderr_log.read_text(encoding="utf-8", errors="replace"))
        handle.write(
            f"supervisor: {outcome['classification']} ({outcome['reason']}); exit "
            f"{outcome['exit_code']}; run record {Path(outcome['run_dir']) / supervise.RUN_FILE}\n"
        )


def check_proof(proof_path: Path, recipe: recipes.Recipe) -> dict:
    """The recovery proof gate of training: :func:`recovery.verdict` for this computation."""
    try:
        proof = atomic.read_json(proof_path)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise StageError(f"{proof_path}: cannot read the recovery proof: {exc}") from exc
    reasons = recovery.verdict(proof, recipe.computation_digest)
    if reasons:
        raise StageError(
            f"{proof_path}: not an acceptable recovery proof of computation "
            f"{recipe.computation_digest}; training is blocked: " + "; ".join(reasons)
        )
    return proof


def qualify(
    recipe_json: Path,
    input_root: Path,
    examples_dir: Path,
    work_dir: Path,
    out_proof: Path,
    log: Path,
    *,
    steps: int | None = None,
    fail_after_step: int | None = None,
    mode: str = recovery.DEFAULT_MODE,
    supervision: supervise.Settings = supervise.QUALIFICATION,
    gpus: list | None = None,
    gpus_per_job: int = 1,
    lease_dir: Path | None = None,
    lease_wait_s: float = 3600.0,
    processes: int = 1,
) -> dict:
    """Recovery proof of the computation; raises with the diagnosis when it does not pass.

    The proof (and all its runs and logs) is kept under ``work_dir/qualification/``
    even when it fails, since Snakemake deletes the declared output of a failed job.
    """
    recipe = recipes.load(recipe_json)
    slots = _lease_gpus(recipe, gpus)
    with leases.lease(
        lease_dir or work_dir / "gpu-leases",
        slots,
        gpus_per_job,
        wait_s=lease_wait_s,
        holder={"job": recipe.job_id, "stage": "qualify"},
    ) as held:
        proof = recovery.prove(
            recipe_json,
            input_root,
            work_dir,
            out_proof,
            steps=steps,
            fail_after_step=fail_after_step,
            mode=mode,
            examples_dir=examples_dir,
            supervision=dataclasses.replace(
                supervision,
                env=_worker_env(recipe, held, supervision.env),
                pass_fds=(*supervision.pass_fds, *held.fds),
            ),
            processes=processes,
        )
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "a", encoding="utf-8") as handle:
        handle.write(f"proof: passed={proof['passed']}: {proof['diagnosis']}\n")
        handle.write(f"proof directory (runs, logs, checkpoints): {proof['proof_dir']}\n")
    if not proof["passed"]:
        raise StageError(
            f"recovery proof of {recipe_json} failed; training is blocked. {proof['diagnosis']} "
            f"Evidence: {Path(proof['proof_dir']) / recovery.PROOF_FILE}"
        )
    return proof


def train_attempt(
    recipe_json: Path,
    input_root: Path,
    examples_dir: Path,
    work_dir: Path,
    out_result: Path,
    out_export: Path,
    log: Path,
    *,
    proof: Path | None = None,
    record_state_hashes: bool | int | str = True,
    allow_environment_change: bool = False,
    supervision: supervise.Settings = supervise.TRAINING,
    gpus: list | None = None,
    gpus_per_job: int = 1,
    lease_dir: Path | None = None,
    lease_wait_s: float = 3600.0,
    processes: int = 1,
    live_delivery: Callable[[Path], supervise.Companion] | None = None,
) -> dict:
    """Run one supervised worker attempt, resuming the computation's latest attempt if any.

    ``live_delivery(attempt_dir)``, when given, makes the supervisor's companion that
    delivers the attempt's events while it trains (:mod:`minifield.tracking.live`).

    Attempts live under ``work_dir`` (not a declared output), so a failed job's
    checkpoints survive Snakemake's clean-up and the next try resumes from them.
    The supervisor's record of each attempt is ``work_dir/runs/<attempt_id>/run.json``.
    """
    from ..attempt import train

    recipe = recipes.load(recipe_json)
    if proof is not None:
        check_proof(proof, recipe)
    job_dir = work_dir / "attempts" / recipe.job_id
    previous = latest_attempt(job_dir)
    attempt_id = train.new_attempt_id()
    args = [
        "--job",
        recipe_json,
        "--input-root",
        input_root,
        "--output-root",
        work_dir / "attempts",
        "--examples",
        examples_dir,
        "--attempt-id",
        attempt_id,
        # Compiled executables persist across attempts: a resumed attempt starts updating sooner.
        "--compilation-cache",
        str(work_dir / "jax-cache"),
    ]
    if previous is not None:
        args += ["--resume-from", previous]
    if record_state_hashes is True:
        args.append("--record-state-hashes")
    elif record_state_hashes:
        # a cadence: every K-th update, or "checkpoint"
        args += ["--state-hash-every", str(record_state_hashes)]
    if allow_environment_change:
        args.append("--allow-environment-change")
    command = supervise.worker_command(*args, processes=processes)
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "a", encoding="utf-8") as handle:
        handle.write(f"$ {' '.join(command)}\n")
    # One attempt of a computation at a time: a worker orphaned by a killed supervisor keeps
    # this lock (inherited descriptor) until it ends, so a new attempt cannot race it.
    work_dir.mkdir(parents=True, exist_ok=True)
    lock_path = work_dir / "train.lock"
    lock_fd = locks.try_lock(lock_path, {"attempt_id": attempt_id, "pid": os.getpid()})
    if lock_fd is None:
        holder = lock_path.read_text(encoding="utf-8", errors="replace").strip()
        raise StageError(
            f"another training attempt of this computation is still running ({lock_path} is "
            f"held by {holder or 'an unknown process'}); wait for it to end or stop it"
        )
    os.set_inheritable(lock_fd, True)
    slots = _lease_gpus(recipe, gpus)
    try:
        with leases.lease(
            lease_dir or work_dir / "gpu-leases",
            slots,
            gpus_per_job,
            wait_s=lease_wait_s,
            holder={"job": recipe.job_id, "attempt_id": attempt_id, "stage": "train"},
        ) as held:
            outcome = supervise.supervise(
                command,
                work_dir / "runs" / attempt_id,
                dataclasses.replace(
                    supervision,
                    env=_worker_env(recipe, held, supervision.env),
                    pass_fds=(*supervision.pass_fds, *held.fds, lock_fd),
                ),
                companion=live_delivery(job_dir / attempt_id) if live_delivery else None,
            )
    finally:
        os.close(lock_fd)
    _append_run_to_log(log, outcome)
    code = outcome["exit_code"]
    attempt_dir = job_dir / attempt_id
    result_path = attempt_dir / RESULT
    if not result_path.is_file():
        raise StageError(
            f"training attempt {attempt_dir} ended {outcome['classification']} "
            f"({outcome['reason']}, exit {code}) without a result.json; the next run resumes "
            f"from its last committed checkpoint. See {log}"
        )
    result = atomic.read_json(result_path)
    if outcome["classification"] != "completed" or result["status"] != "completed":
        error = result.get("error") or {}
        detail = f": {error.get('phase')}: {error.get('message')}" if error else ""
        advice = {
            train.EXIT_INVALID: "a retry cannot fix this: correct the recipe, inputs or "
            "environment first",
            train.EXIT_IO: f"free space on the disk of {job_dir}; the next run resumes from its "
            "last committed checkpoint",
        }.get(code, "the next run resumes from its last committed checkpoint")
        raise StageError(
            f"training attempt {attempt_dir} ended {result['status']} "
            f"(supervisor: {outcome['classification']}, exit {code}){detail}; {advice}. Log: {log}"
        )
    if out_export.exists():
        shutil.rmtree(out_export)
    shutil.copytree(attempt_dir / EXPORT, out_export)
    atomic.write_json(
        out_result,
        {
            **result,
            "attempt_dir": str(attempt_dir),
            "supervision": {
                "run_json": str(Path(outcome["run_dir"]) / supervise.RUN_FILE),
                "classification": outcome["classification"],
                "gpus": held.gpus,
            },
        },
    )
    return result


def _retained_checkpoints(attempt_dir: Path) -> list[Path]:
    """Committed checkpoints along the attempt chain, one per step (the newest attempt's wins)."""
    from ..state import checkpoint

    by_step: dict[int, Path] = {}
    for directory in newest_first(attempt_dir):
        ckpt_dir = directory / CHECKPOINTS
        for step in checkpoint.committed_steps(ckpt_dir):
            by_step.setdefault(step, ckpt_dir / checkpoint.step_dir_name(step))
    return [by_step[s] for s in sorted(by_step)]


def _load_selected(path: Path, sha256: str, program, computation_digest: str):
    """The selected checkpoint's state, verified again, and still the one DEV scored."""
    from ..state import checkpoint

    state, _ = checkpoint.load(path, program.init_state(), computation_digest=computation_digest)
    if checkpoint.manifest_sha256(path) != sha256:
        raise StageError(f"{path} changed while it was being evaluated (manifest sha256)")
    return state


def evaluate(
    recipe_json: Path,
    train_result: Path,
    examples_dir: Path,
    out_metrics: Path,
    out_selected_export: Path | None = None,
) -> dict:
    """Evaluate every retained checkpoint on DEV, select one on DEV, assess TEST for it only.

    One checkpoint's state is held at a time (loaded, scored, dropped); the selected one is
    loaded again for TEST. With ``out_selected_export``, the selected checkpoint's weights
    are exported there (the train stage exports the final ones).
    """
    from ..state import checkpoint

    recipe = recipes.load(recipe_json)
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
