"""The recovery proof: evidence that an interrupted and resumed run is the same computation.

A qualification is the recipe's own computation truncated to ``steps`` updates
(``--stop-after-step``: an operational limit, not part of the computation
digest). Every run is a real worker under the supervisor. The proof runs an
uninterrupted **reference** that records the complete-state hash (and one hash per
state part) after every update, then one or both interruptions (``mode``):

- **crash**: a **faulted** run hard-exits right after update ``k``
  (``--fail-after-step``); its **last committed checkpoint** (step ≤ k) is verified
  independently of the worker (every array's hash, shape and dtype, the recomputed
  state hash), and a **resumed** run in a new attempt must restore exactly it;
- **preempt**: the supervisor sends SIGTERM once it sees update ``k`` (the worker holds
  still after that update, ``--stall-after-step``, so the signal lands before update
  ``k+1``); the worker commits a checkpoint and exits 3 with a durable receipt (its
  ``preempted`` event and ``result.json``) naming the checkpoint of step ``k``; a new
  attempt must restore that very checkpoint (same path, same sha256).

Each resumed run is then **compared** with the reference: the restored state, the next
update and every later complete-state hash. The first divergence names the step and the
state part(s) that differ. A plausible final loss is not evidence; equal complete-state
hashes are.

The runs are in :mod:`.runs`, the comparison in :mod:`.comparison`; :mod:`.verdict` is the
one judgement of a proof document, used by the training gate, the store's publication and
its activation: it recomputes the comparison from the hashes the document records and
trusts neither ``passed`` nor ``first_divergence``.
"""

from __future__ import annotations

import datetime as dt
import time
from pathlib import Path
from typing import Any

from .. import atomic
from ..supervision import accelerator
from ..supervision import supervise as supervisor
from .comparison import compare_with_reference, divergence_text
from .document import (
    DEFAULT_MODE,
    EXIT_PREEMPTED,
    FORMAT,
    LEGACY_MODE,
    MODES,
    PREEMPT_HOLD_S,
    PROOF_FILE,
    PROOF_HASH_EVERY,
    parts,
)
from .runs import (
    ProofProblem,
    Runs,
    last_committed_checkpoint,
    receipt_checkpoint,
    run_faulted,
    run_preempted,
    run_reference,
    run_resumed,
    verify_checkpoint,
)


def default_settings(recipe) -> dict:
    """Qualification length and fault point derived from the recipe's checkpoint cadence.

    ``steps = min(max_steps, 2*every + 2)`` and ``k = every + 1``: the fault lands one
    update after the first checkpoint, so the resumed run must redo a lost update,
    cross a checkpoint written by the new attempt, and continue past it. The preemption
    uses the same ``k``: off the cadence, so its checkpoint is the one the signal made.
    """
    every = recipe.data["checkpoint"]["every_steps"]
    max_steps = recipe.data["limits"]["max_steps"]
    return {"steps": min(max_steps, 2 * every + 2), "fail_after_step": every + 1}


def settings_problem(
    recipe,
    steps: int,
    k: int,
    mode: str = DEFAULT_MODE,
    supervision: supervisor.Settings = supervisor.QUALIFICATION,
) -> str | None:
    every = recipe.data["checkpoint"]["every_steps"]
    max_steps = recipe.data["limits"]["max_steps"]
    if mode not in MODES:
        return f"qualification mode={mode!r} must be one of {', '.join(MODES)}"
    if not 1 <= steps <= max_steps:
        return f"qualification steps={steps} must be between 1 and the recipe's limits.max_steps={max_steps}"
    if not 1 <= k < steps:
        return f"qualification fail_after_step={k} must be at least 1 and below steps={steps}"
    if "crash" in parts(mode) and k < every:
        return (
            f"qualification fail_after_step={k} is before the first checkpoint "
            f"(checkpoint.every_steps={every}): there would be no committed checkpoint to resume "
            f"from; choose fail_after_step >= {every}"
        )
    if "preempt" in parts(mode) and supervision.stall_s <= PREEMPT_HOLD_S:
        return (
            f"the stall timeout stall_s={supervision.stall_s} must exceed the "
            f"{PREEMPT_HOLD_S} s the preempted run holds still after update {k}"
        )
    return None


def crash_part(runs: Runs, proof: dict, reference: dict[int, dict], k: int) -> bool:
    """Crash after update k, verify the last committed checkpoint, resume, compare.

    Its evidence is the proof's top-level ``faulted``, ``checkpoint_used``, ``resumed``,
    ``comparison``, ``next_update`` and ``first_divergence`` (the format's first part).
    """
    faulted_dir = run_faulted(runs, proof, k)
    used = last_committed_checkpoint(proof, faulted_dir, k)
    verify_checkpoint(runs, used)
    resumed = run_resumed(runs, proof, "resumed", faulted_dir, used)
    return compare_with_reference(runs, proof, reference, resumed, used)


def preempt_part(runs: Runs, proof: dict, reference: dict[int, dict], k: int) -> bool:
    """Preempt after update k through the supervisor, resume from the receipt, compare.

    Its evidence is the proof's ``preempted`` section.
    """
    section = proof["preempted"] = {
        "after_step": k,
        "hold_s": PREEMPT_HOLD_S,
        "passed": False,
        "run": None,
        "receipt": None,
        "checkpoint_used": None,
        "resumed": None,
        "comparison": None,
        "next_update": None,
        "first_divergence": None,
    }
    preempted_dir = run_preempted(runs, section, k)
    used = receipt_checkpoint(section)
    verify_checkpoint(runs, used)
    resumed = run_resumed(runs, section, "resumed-after-preemption", preempted_dir, used)
    section["passed"] = compare_with_reference(runs, section, reference, resumed, used)
    return section["passed"]


def _crash_diagnosis(proof: dict) -> str:
    div, used, settings = proof["first_divergence"], proof["checkpoint_used"], proof["settings"]
    if div is not None:
        return divergence_text(div, "crash")
    return (
        f"Recovery from a crash reproduced the computation exactly: the run that crashed after "
        f"update {settings['fail_after_step']} was resumed in a new attempt from the verified "
        f"checkpoint at step {used['step']}; the restored state, the next update (step "
        f"{used['step'] + 1}) and every complete-state hash up to step {settings['steps']} "
        "equal the uninterrupted reference."
    )


def _preempt_diagnosis(proof: dict) -> str:
    section, settings = proof["preempted"], proof["settings"]
    if section["first_divergence"] is not None:
        return divergence_text(section["first_divergence"], "preemption")
    used = section["checkpoint_used"]
    return (
        f"Recovery from a preemption reproduced the computation exactly: the supervisor's "
        f"SIGTERM after update {section['after_step']} made the worker commit the checkpoint "
        f"of step {used['step']} and exit {EXIT_PREEMPTED} with a receipt naming it; the new "
        "attempt restored that very checkpoint (same path and sha256), and every later "
        f"complete-state hash up to step {settings['steps']} equals the reference."
    )


def _diagnosis(proof: dict) -> str:
    if proof.get("problem"):
        return proof["problem"]
    mode = proof["settings"].get("mode", LEGACY_MODE)
    texts = {"crash": _crash_diagnosis, "preempt": _preempt_diagnosis}
    return " ".join(texts[part](proof) for part in parts(mode))


def prove(
    recipe_path: Path,
    input_root: Path,
    work_dir: Path,
    out_proof: Path | None = None,
    *,
    steps: int | None = None,
    fail_after_step: int | None = None,
    mode: str = DEFAULT_MODE,
    examples_dir: Path | None = None,
    quantized_base_dir: Path | None = None,
    supervision: supervisor.Settings = supervisor.QUALIFICATION,
    processes: int = 1,
) -> dict:
    """Run the recovery proof for ``recipe_path``; write and return ``proof.json``.

    Runs live under ``work_dir/qualification/<proof-id>/`` and are kept (logs,
    events, checkpoints). ``passed`` is False (never an exception) when recovery
    does not reproduce the reference; the diagnosis says why.
    """
    from .. import recipe as recipes

    # the prover's own checks (the checkpoint loaded, its state hash) run on the CPU: the
    # resumed worker must find the accelerator free
    accelerator.keep_off()
    recipe = recipes.load(recipe_path)
    defaults = default_settings(recipe)
    steps = defaults["steps"] if steps is None else int(steps)
    k = defaults["fail_after_step"] if fail_after_step is None else int(fail_after_step)
    started = time.monotonic()
    proof_id = dt.datetime.now(dt.UTC).strftime("p%Y%m%dT%H%M%S%fZ")
    base = Path(work_dir) / "qualification" / proof_id
    proof: dict[str, Any] = {
        "format": FORMAT,
        "passed": False,
        "computation_digest": recipe.computation_digest,
        "recipe": str(recipe_path),
        "strategy": {"name": recipe.strategy.name, "version": recipe.strategy.version},
        "settings": {
            "mode": mode,
            "steps": steps,
            "fail_after_step": k,
            "preempt_after_step": k if mode in ("preempt", "both") else None,
            "every_steps": recipe.data["checkpoint"]["every_steps"],
            "max_steps": recipe.data["limits"]["max_steps"],
            "state_hash_every": PROOF_HASH_EVERY,
            **supervision.bounds(),
            "processes": processes,
        },
        "proof_dir": str(base),
        "reference": None,
        "faulted": None,
        "checkpoint_used": None,
        "resumed": None,
        "comparison": None,
        "next_update": None,
        "first_divergence": None,
        "preempted": None,
        "problem": None,
        "created": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
    }
    base.mkdir(parents=True, exist_ok=True)
    parts_passed: list[bool] = []
    try:
        problem = settings_problem(recipe, steps, k, mode, supervision)
        if problem:
            raise ProofProblem(problem)
        runs = Runs(
            recipe,
            Path(recipe_path),
            Path(input_root),
            Path(work_dir),
            base,
            steps=steps,
            examples_dir=examples_dir,
            quantized_base_dir=quantized_base_dir,
            supervision=supervision,
            processes=processes,
        )
        reference = run_reference(runs, proof)
        # A divergence in one part does not stop the other: both are evidence.
        if "crash" in parts(mode):
            parts_passed.append(crash_part(runs, proof, reference, k))
        if "preempt" in parts(mode):
            parts_passed.append(preempt_part(runs, proof, reference, k))
    except ProofProblem as exc:
        proof["problem"] = str(exc)
    proof["passed"] = proof["problem"] is None and bool(parts_passed) and all(parts_passed)
    proof["diagnosis"] = _diagnosis(proof)
    proof["seconds"] = time.monotonic() - started
    atomic.write_json(base / PROOF_FILE, proof)
    if out_proof is not None:
        atomic.write_json(out_proof, proof)
    return proof
