"""The stages that run supervised workers: ``qualify`` (the recovery proof that gates
training) and ``train`` (one attempt, resuming the computation's latest).

Both hold GPU leases for their workers; ``train`` also holds the computation's one-attempt
lock. Neither imports JAX: the workers they supervise train, and a supervising process that
loaded JAX would pay its import (docs/development.md, "Start-up cost") for nothing.
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
from ..attempt.layout import ATTEMPT_JSON, EXPORT, RESULT, new_attempt_id
from ..attempt.options import computation_cache
from ..attempt.result import EXIT_DEVICE_BUSY, EXIT_INVALID, EXIT_IO
from ..proof.document import DEFAULT_MODE, PROOF_FILE
from ..proof.prove import prove
from ..proof.verdict import verdict
from ..supervision import accelerator, leases, locks, supervise
from .errors import StageError


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
    # the platforms the first parent was given, then this recipe's own say (a CPU recipe)
    env = accelerator.worker_env(held.env(os.environ if base is None else base))
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
    """The recovery proof gate of training: :func:`verdict` for this computation."""
    try:
        proof = atomic.read_json(proof_path)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise StageError(f"{proof_path}: cannot read the recovery proof: {exc}") from exc
    reasons = verdict(proof, recipe.computation_digest)
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
    quantized_base_dir: Path | None = None,
    steps: int | None = None,
    fail_after_step: int | None = None,
    mode: str = DEFAULT_MODE,
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
        proof = prove(
            recipe_json,
            input_root,
            work_dir,
            out_proof,
            steps=steps,
            fail_after_step=fail_after_step,
            mode=mode,
            examples_dir=examples_dir,
            quantized_base_dir=quantized_base_dir,
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
        evidence = Path(proof["proof_dir"]) / PROOF_FILE
        failure = worker_failure(proof)
        if failure:
            raise StageError(
                f"recovery proof of {recipe_json} failed: {failure}; training is blocked. "
                f"Evidence: {evidence}"
            )
        raise StageError(
            f"recovery proof of {recipe_json} failed; training is blocked. {proof['diagnosis']} "
            f"Evidence: {evidence}"
        )
    return proof


def worker_failure(proof: dict) -> str | None:
    """What the first of the proof's runs that should have completed said when its worker
    recorded an error (a reward that raised, a row it refused), as one clause; None when none
    did (the proof failed on its own terms: a divergence, a checkpoint). The faulted and the
    preempted runs end with an error by design and are not read."""
    preempted = proof.get("preempted") or {}
    sections = (
        ("reference", proof.get("reference")),
        ("resumed", proof.get("resumed")),
        ("resumed after preemption", preempted.get("resumed")),
    )
    for name, run in sections:
        error = run.get("error") if isinstance(run, dict) else None
        if error:
            return f"the {name} run's worker failed ({error.get('phase')}): {error.get('message')}"
    return None


def train_attempt(
    recipe_json: Path,
    input_root: Path,
    examples_dir: Path,
    work_dir: Path,
    out_result: Path,
    out_export: Path,
    log: Path,
    *,
    quantized_base_dir: Path | None = None,
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
    recipe = recipes.load(recipe_json)
    if proof is not None:
        check_proof(proof, recipe)
    job_dir = work_dir / "attempts" / recipe.job_id
    attempt_id = new_attempt_id()
    args = _worker_args(
        recipe_json,
        input_root,
        examples_dir,
        work_dir,
        attempt_id,
        quantized_base_dir=quantized_base_dir,
        previous=latest_attempt(job_dir),
        record_state_hashes=record_state_hashes,
        allow_environment_change=allow_environment_change,
    )
    command = supervise.worker_command(*args, processes=processes)
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "a", encoding="utf-8") as handle:
        handle.write(f"$ {' '.join(command)}\n")
    lock_fd = _lock_computation(work_dir, attempt_id)
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
    attempt_dir = job_dir / attempt_id
    result = _completed_result(attempt_dir, outcome, log)
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


def _worker_args(
    recipe_json: Path,
    input_root: Path,
    examples_dir: Path,
    work_dir: Path,
    attempt_id: str,
    *,
    quantized_base_dir: Path | None = None,
    previous: Path | None,
    record_state_hashes: bool | int | str,
    allow_environment_change: bool,
) -> list:
    """The worker's command-line arguments for this attempt."""
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
        str(computation_cache(work_dir)),
    ]
    if quantized_base_dir is not None:
        args += ["--quantized-base", quantized_base_dir]
    if previous is not None:
        args += ["--resume-from", previous]
    if record_state_hashes is True:
        args.append("--record-state-hashes")
    elif record_state_hashes:
        # a cadence: every K-th update, or "checkpoint"
        args += ["--state-hash-every", str(record_state_hashes)]
    if allow_environment_change:
        args.append("--allow-environment-change")
    return args


def _lock_computation(work_dir: Path, attempt_id: str) -> int:
    """The descriptor of the computation's training lock, taken for ``attempt_id``."""
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
    return lock_fd


def _completed_result(attempt_dir: Path, outcome: dict, log: Path) -> dict:
    """The attempt's result when it completed; otherwise a StageError that says what ended it
    and whether a retry can help."""
    code = outcome["exit_code"]
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
            EXIT_INVALID: "a retry cannot fix this: correct the recipe, inputs or "
            "environment first",
            EXIT_IO: f"free space on the disk of {attempt_dir.parent}; the next run resumes "
            "from its last committed checkpoint",
            EXIT_DEVICE_BUSY: "the accelerator was held by the process named: let it end; "
            "the next run resumes from the last committed checkpoint",
        }.get(code, "the next run resumes from its last committed checkpoint")
        if error.get("phase") == "diverged":
            # the computation is deterministic: resumed, it diverges at the same update
            advice = "a retry diverges again: change the recipe (learning rate, base model) first"
        raise StageError(
            f"training attempt {attempt_dir} ended {result['status']} "
            f"(supervisor: {outcome['classification']}, exit {code}){detail}; {advice}. Log: {log}"
        )
    return result
