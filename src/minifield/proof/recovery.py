"""Recovery proof: evidence that an interrupted and resumed run is the same computation.

A qualification is the recipe's own computation truncated to ``steps`` updates
(``--stop-after-step``: an operational limit, not part of the computation
digest). Every run is a real worker under the supervisor. The proof runs an
uninterrupted **reference** that records the complete-state hash (and one hash per
state part) after every update, then one or both interruptions (``mode``):

- **crash**: a **faulted** run hard-exits right after update ``k``
  (``--fail-after-step``); its **last committed checkpoint** (step ≤ k) is verified
  independently of the worker (every array's sha256, shape and dtype, the recomputed
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

:func:`verdict` is the one judgement of a proof document, used by the training gate, the
store's publication and its activation: it recomputes the comparison from the hashes the
document records and trusts neither ``passed`` nor ``first_divergence``.
"""

from __future__ import annotations

import datetime as dt
import os
import time
from pathlib import Path
from typing import Any

from .. import atomic
from ..attempt.events import read as read_events
from ..attempt.layout import ATTEMPT_JSON, CHECKPOINTS, EVENTS, RESULT
from ..supervision import supervise as supervisor

FORMAT = "minifield-proof/1"
PROOF_FILE = "proof.json"
MODES = ("crash", "preempt", "both")
DEFAULT_MODE = "both"
#: a proof written before the preemption mode existed proved a crash only
LEGACY_MODE = "crash"
#: seconds the preempted run's worker holds still after update k: the supervisor's SIGTERM
#: (sent within a poll interval of seeing that update's event) must land before update k+1
PREEMPT_HOLD_S = 3.0
#: the state-hash cadence of the proof's runs: every update, since every update after the
#: restored checkpoint is compared (the verdict refuses a proof recorded at another one)
PROOF_HASH_EVERY = 1
#: the worker's exit codes the proof relies on (0 completed, 1 failed, 2 invalid, 3 preempted,
#: 4 limit)
EXIT_FAILED, EXIT_PREEMPTED = 1, supervisor.WORKER_PREEMPTED


class ProofProblem(Exception):
    """The proof could not be carried out as designed; the message becomes ``problem``."""


def _parts(mode: str) -> tuple[str, ...]:
    return {"crash": ("crash",), "preempt": ("preempt",), "both": ("crash", "preempt")}[mode]


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
    if "crash" in _parts(mode) and k < every:
        return (
            f"qualification fail_after_step={k} is before the first checkpoint "
            f"(checkpoint.every_steps={every}): there would be no committed checkpoint to resume "
            f"from; choose fail_after_step >= {every}"
        )
    if "preempt" in _parts(mode) and supervision.stall_s <= PREEMPT_HOLD_S:
        return (
            f"the stall timeout stall_s={supervision.stall_s} must exceed the "
            f"{PREEMPT_HOLD_S} s the preempted run holds still after update {k}"
        )
    return None


# -- the runs ------------------------------------------------------------------------------
def _updates(events: list[dict]) -> dict[int, dict]:
    return {e["step"]: e for e in events if e["type"] == "update"}


def _hash_list(updates: dict[int, dict]) -> list[dict]:
    return [{"step": s, "state_hash": updates[s].get("state_hash")} for s in sorted(updates)]


def _run_record(outcome: dict, attempt_dir: Path) -> dict:
    events_path = attempt_dir / EVENTS
    result_path = attempt_dir / RESULT
    result = atomic.read_json(result_path) if result_path.is_file() else None
    return {
        "attempt_dir": str(attempt_dir),
        "run_json": str(Path(outcome["run_dir"]) / supervisor.RUN_FILE),
        "stdout_log": outcome.get("stdout_log"),
        "stderr_log": outcome.get("stderr_log"),
        "events_file": str(events_path),
        "classification": outcome["classification"],
        "exit_code": outcome["exit_code"],
        "signal": outcome.get("signal"),
        "pid": outcome.get("pid"),
        "duration_s": outcome.get("duration_s"),
        "status": result.get("status") if result else None,
        "steps_completed": result.get("steps_completed") if result else None,
        "error": result.get("error") if result else None,
    }


class _Runs:
    """Starts the proof's worker runs, each under the supervisor, in one proof directory."""

    def __init__(
        self,
        recipe,
        recipe_path: Path,
        input_root: Path,
        work_dir: Path,
        base: Path,
        *,
        steps: int,
        examples_dir: Path | None,
        supervision: supervisor.Settings,
        processes: int,
    ):
        self.recipe, self.input_root, self.examples_dir = recipe, input_root, examples_dir
        self.base, self.steps = base, steps
        self.supervision, self.processes = supervision, processes
        out_root = base / "attempts"
        self.job_dir = out_root / recipe.job_id
        self.common: list[str | Path] = [
            "--job", recipe_path, "--input-root", input_root, "--output-root", out_root,
            "--stop-after-step", str(steps),
            # every update carries its state hash: the proof compares every update
            "--state-hash-every", str(PROOF_HASH_EVERY),
            # Shared with training: the proof's runs compile once, and the proof then also
            # covers a resume that loads its executable from the persistent cache.
            "--compilation-cache", Path(work_dir) / "jax-cache",
        ]  # fmt: skip
        if examples_dir is not None:
            self.common += ["--examples", examples_dir]
        self._program = None

    def launch(
        self, name: str, *extra: str | Path, preempt_after_step: int | None = None
    ) -> tuple[dict, Path, list[dict]]:
        """(supervisor outcome, attempt directory, the attempt's events) of one run."""
        command = supervisor.worker_command(
            *self.common, "--attempt-id", name, *extra, processes=self.processes
        )
        outcome = supervisor.supervise(
            command,
            self.base / "runs" / name,
            self.supervision,
            preempt_after_step=preempt_after_step,
        )
        attempt_dir = self.job_dir / name
        events_file = attempt_dir / EVENTS
        events = read_events(events_file)[0] if events_file.is_file() else []
        return outcome, attempt_dir, events

    def program(self):
        """The recipe's program, built here to verify checkpoints independently of the worker."""
        if self._program is None:
            from ..inputs import examples, pinned

            recipe = self.recipe
            if self.examples_dir is not None:
                arrays, _ = examples.load(self.examples_dir, recipe.examples_digest)
            else:
                files = pinned.files_by_name(recipe.data, self.input_root)
                arrays, _ = recipe.strategy.prepare(recipe.data, files)
            self._program = recipe.strategy.build(recipe.data, arrays)
        return self._program


# -- the steps (each records its evidence first, then raises ProofProblem if it must) -----
def run_reference(runs: _Runs, proof: dict) -> dict[int, dict]:
    """The uninterrupted reference; returns its update events by step."""
    outcome, attempt_dir, events = runs.launch("reference")
    record = proof["reference"] = _run_record(outcome, attempt_dir)
    updates = _updates(events)
    record["state_hashes"] = _hash_list(updates)
    steps = runs.steps
    if record["steps_completed"] != steps or sorted(updates) != list(range(1, steps + 1)):
        raise ProofProblem(
            f"The uninterrupted reference did not complete {steps} updates "
            f"({outcome['classification']}: {outcome['reason']}; worker status "
            f"{record['status']}, error {record['error']}); see {outcome['stderr_log']}"
        )
    return updates


def run_faulted(runs: _Runs, proof: dict, k: int) -> Path:
    """The same computation crashing hard right after update ``k``; returns its attempt dir."""
    outcome, attempt_dir, events = runs.launch("faulted", "--fail-after-step", str(k))
    record = proof["faulted"] = _run_record(outcome, attempt_dir)
    # The supervisor reaped the child itself (exit_code is its wait status): that, not a
    # later look at the pid (which another process may have taken by then), shows it ended.
    record["exited"] = outcome["exit_code"] is not None
    updates = _updates(events)
    record["last_update_step"] = max(updates, default=0)
    record["state_hashes"] = _hash_list(updates)
    if outcome["classification"] != "failed" or outcome["exit_code"] != EXIT_FAILED:
        raise ProofProblem(
            f"The faulted run did not end as the injected crash (classification "
            f"{outcome['classification']}, exit {outcome['exit_code']}, expected failed with "
            f"exit {EXIT_FAILED}); see {outcome['stderr_log']}"
        )
    if record["last_update_step"] != k:
        raise ProofProblem(
            f"The faulted run's last update is step {record['last_update_step']}, expected the "
            f"injected fault right after update {k}; see {outcome['stderr_log']}"
        )
    return attempt_dir


def last_committed_checkpoint(proof: dict, attempt_dir: Path, k: int) -> dict:
    """The newest committed checkpoint of the faulted run (what a resume must restore)."""
    from ..state import checkpoint

    ckpt_root = attempt_dir / CHECKPOINTS
    committed = checkpoint.committed_steps(ckpt_root)
    if not committed:
        raise ProofProblem(f"The faulted run left no committed checkpoint in {ckpt_root}")
    last = committed[-1]
    path = ckpt_root / checkpoint.step_dir_name(last)
    record = proof["checkpoint_used"] = {
        "step": last,
        "path": str(path),
        "sha256": checkpoint.manifest_sha256(path),
    }
    if last > k:
        raise ProofProblem(f"Checkpoint step {last} is after the fault at update {k}")
    return record


def run_preempted(runs: _Runs, section: dict, k: int) -> Path:
    """The same computation preempted by the supervisor's SIGTERM after update ``k``.

    Returns its attempt dir; ``section["receipt"]`` is what the worker left behind: the
    checkpoint its ``preempted`` event and its ``result.json`` name (they must agree).
    """
    outcome, attempt_dir, events = runs.launch(
        "preempted",
        *("--stall-after-step", str(k), "--stall-seconds", str(PREEMPT_HOLD_S)),
        preempt_after_step=k,
    )
    record = section["run"] = _run_record(outcome, attempt_dir)
    record["termination_by"] = (outcome.get("termination") or {}).get("by")
    updates = _updates(events)
    record["last_update_step"] = max(updates, default=0)
    record["state_hashes"] = _hash_list(updates)
    event = next((e for e in events if e["type"] == "preempted"), None)
    result_path = attempt_dir / RESULT
    result = atomic.read_json(result_path) if result_path.is_file() else {}
    receipt = section["receipt"] = {
        "step": event.get("step") if event else None,
        "path": event.get("path") if event else None,
        "sha256": event.get("checkpoint_sha256") if event else None,
        "signal": event.get("signal") if event else None,
        "result_status": result.get("status"),
        "result_checkpoint": result.get("checkpoint"),
    }
    if (
        record["termination_by"] != "preempt"
        or outcome["classification"] != "preempted"
        or outcome["exit_code"] != EXIT_PREEMPTED
    ):
        raise ProofProblem(
            f"The preempted run did not end as a preemption by the supervisor (termination by "
            f"{record['termination_by']}, classification {outcome['classification']}, exit "
            f"{outcome['exit_code']}, expected preempted with exit {EXIT_PREEMPTED}); see "
            f"{outcome['stderr_log']}"
        )
    if event is None or receipt["result_status"] != "preempted":
        raise ProofProblem(
            f"The preempted run left no durable receipt (preempted event: {event is not None}, "
            f"result.json status {receipt['result_status']!r}) in {attempt_dir}"
        )
    named = {key: receipt[key] for key in ("step", "path", "sha256")}
    if receipt["result_checkpoint"] != named:
        raise ProofProblem(
            f"The preempted run's receipts disagree: its preempted event names {named}, its "
            f"result.json {receipt['result_checkpoint']}"
        )
    if receipt["step"] != k:
        raise ProofProblem(
            f"The preempted run's receipt names the checkpoint of step {receipt['step']}, "
            f"expected step {k}: the SIGTERM sent on update {k} arrived after the worker went "
            f"on (it holds still {PREEMPT_HOLD_S} s); see {outcome['run_dir']}"
        )
    return attempt_dir


def receipt_checkpoint(section: dict) -> dict:
    """The checkpoint the preemption receipt names, its manifest hashed again here."""
    from ..state import checkpoint

    receipt = section["receipt"]
    path = Path(receipt["path"])
    record = section["checkpoint_used"] = {
        "step": receipt["step"],
        "path": receipt["path"],
        "sha256": checkpoint.manifest_sha256(path) if path.is_dir() else None,
    }
    if record["sha256"] != receipt["sha256"]:
        raise ProofProblem(
            f"The checkpoint the receipt names ({path}) has manifest sha256 "
            f"{record['sha256']}, the receipt says {receipt['sha256']}"
        )
    return record


def verify_checkpoint(runs: _Runs, record: dict) -> None:
    """Load the checkpoint ``record`` names and check every array and the state hash."""
    from ..state import checkpoint

    try:
        _, manifest = checkpoint.load(
            Path(record["path"]),
            runs.program().init_state(),
            computation_digest=runs.recipe.computation_digest,
        )
    except checkpoint.CheckpointError as exc:
        record["verified"] = False
        raise ProofProblem(f"The checkpoint {record['path']} does not verify: {exc}") from exc
    record["verified"] = True
    record["state_hash"] = manifest["state_hash"]


def run_resumed(
    runs: _Runs, section: dict, name: str, from_dir: Path, expected: dict
) -> dict[int, dict]:
    """A new attempt resuming from ``from_dir``; it must restore the ``expected`` checkpoint.

    What it restored is read from its own records (``attempt.json``, its ``restored``
    event). Returns its update events by step.
    """
    outcome, attempt_dir, events = runs.launch(name, "--resume-from", from_dir)
    record = section["resumed"] = _run_record(outcome, attempt_dir)
    info_path = attempt_dir / ATTEMPT_JSON
    info = atomic.read_json(info_path) if info_path.is_file() else {}
    record["resumed_from"] = info.get("resumed_from")
    restored = next((e for e in events if e["type"] == "restored"), None)
    record["restored"] = (
        {key: restored.get(key) for key in ("step", "path", "sha256", "state_hash")}
        if restored
        else None
    )
    updates = _updates(events)
    record["state_hashes"] = _hash_list(updates)
    if record["resumed_from"] is None or Path(record["resumed_from"]) != from_dir.resolve():
        raise ProofProblem(
            f"The resumed run's attempt.json names {record['resumed_from']!r} as the attempt it "
            f"resumed from, not {from_dir}; see {outcome['stderr_log']}"
        )
    if restored is None:
        raise ProofProblem(
            f"The resumed run did not restore a checkpoint ({outcome['classification']}: "
            f"{record['error'] or outcome['reason']}); see {outcome['stderr_log']}"
        )
    same_path = Path(restored["path"]).resolve() == Path(expected["path"]).resolve()
    if (
        restored["step"] != expected["step"]
        or restored["sha256"] != expected["sha256"]
        or not (same_path)
    ):
        raise ProofProblem(
            f"The resumed run restored the checkpoint of step {restored['step']} "
            f"({restored['path']}, sha256 {restored['sha256']}), not the one at step "
            f"{expected['step']} ({expected['path']}, sha256 {expected['sha256']})"
        )
    return updates


def _manifest_part_diff(a: Path, b: Path) -> list[str]:
    """State parts whose arrays differ between two checkpoint manifests."""
    from ..state import checkpoint

    ma, mb = atomic.read_json(a / checkpoint.MANIFEST), atomic.read_json(b / checkpoint.MANIFEST)
    sa = {e["name"]: e["sha256"] for e in ma["arrays"]}
    sb = {e["name"]: e["sha256"] for e in mb["arrays"]}
    return sorted({n.split("/", 1)[0] for n in set(sa) | set(sb) if sa.get(n) != sb.get(n)})


def compare(
    reference: dict[int, dict],
    resumed: dict[int, dict],
    *,
    restored_step: int,
    restored_state_hash: str | None,
    steps: int,
) -> dict:
    """Compare the restored state and every resumed update with the reference.

    ``reference``/``resumed`` map step → update event (with ``state_hash`` and
    ``part_hashes``). Returns the comparison rows, the next-update comparison and
    the first divergence (or None).
    """
    rows = []
    divergence = None
    if restored_step > 0:
        ref = reference.get(restored_step, {})
        equal = restored_state_hash is not None and restored_state_hash == ref.get("state_hash")
        rows.append(
            {
                "step": restored_step,
                "what": "restored checkpoint",
                "reference": ref.get("state_hash"),
                "resumed": restored_state_hash,
                "equal": equal,
            }
        )
        if not equal:
            divergence = {
                "step": restored_step,
                "what": "restored checkpoint",
                "parts": None,  # filled from the checkpoint manifests by the caller
                "reference_state_hash": ref.get("state_hash"),
                "resumed_state_hash": restored_state_hash,
            }
    next_update = None
    for step in range(restored_step + 1, steps + 1):
        ref, res = reference.get(step), resumed.get(step)
        row = {
            "step": step,
            "what": "update",
            "reference": ref.get("state_hash") if ref else None,
            "resumed": res.get("state_hash") if res else None,
        }
        row["equal"] = bool(ref and res and row["reference"] and row["reference"] == row["resumed"])
        rows.append(row)
        if step == restored_step + 1:
            next_update = {
                **row,
                "reference_loss": ref.get("loss") if ref else None,
                "resumed_loss": res.get("loss") if res else None,
            }
        if not row["equal"] and divergence is None:
            if ref is None or res is None:
                parts = None
                missing = "reference" if ref is None else "resumed run"
            else:
                rp, sp = ref.get("part_hashes") or {}, res.get("part_hashes") or {}
                parts = sorted(p for p in set(rp) | set(sp) if rp.get(p) != sp.get(p))
                missing = None
            divergence = {
                "step": step,
                "what": "update",
                "parts": parts,
                "missing_in": missing,
                "reference_state_hash": row["reference"],
                "resumed_state_hash": row["resumed"],
            }
    return {"rows": rows, "next_update": next_update, "first_divergence": divergence}


def compare_with_reference(
    runs: _Runs,
    section: dict,
    reference: dict[int, dict],
    resumed: dict[int, dict],
    checkpoint_used: dict,
) -> bool:
    """Compare a resumed run with the reference into ``section``; True when all equal."""
    from ..state import checkpoint

    restored = section["resumed"]["restored"]
    start = checkpoint_used["step"]
    result = compare(
        reference,
        resumed,
        restored_step=start,
        restored_state_hash=restored.get("state_hash"),
        steps=runs.steps,
    )
    div = result["first_divergence"]
    if div is not None and div["what"] == "restored checkpoint":
        ref_ckpt = runs.job_dir / "reference" / CHECKPOINTS / checkpoint.step_dir_name(start)
        if (ref_ckpt / checkpoint.MANIFEST).is_file():
            div["parts"] = _manifest_part_diff(ref_ckpt, Path(checkpoint_used["path"]))
    section["comparison"] = result["rows"]
    section["next_update"] = result["next_update"]
    section["first_divergence"] = div
    return (
        div is None
        and section["resumed"]["steps_completed"] == runs.steps
        and all(row["equal"] for row in result["rows"])
        and len(result["rows"]) >= runs.steps - start
    )


def crash_part(runs: _Runs, proof: dict, reference: dict[int, dict], k: int) -> bool:
    """Crash after update k, verify the last committed checkpoint, resume, compare.

    Its evidence is the proof's top-level ``faulted``, ``checkpoint_used``, ``resumed``,
    ``comparison``, ``next_update`` and ``first_divergence`` (the format's first part).
    """
    faulted_dir = run_faulted(runs, proof, k)
    used = last_committed_checkpoint(proof, faulted_dir, k)
    verify_checkpoint(runs, used)
    resumed = run_resumed(runs, proof, "resumed", faulted_dir, used)
    return compare_with_reference(runs, proof, reference, resumed, used)


def preempt_part(runs: _Runs, proof: dict, reference: dict[int, dict], k: int) -> bool:
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


_PART_HINTS = {
    "params": "parameters differ: the update computation is not reproducible after a restore",
    "opt_state": "optimizer state differs: it is not fully saved or restored",
    "rng": "the random key differs: the RNG state is not part of the checkpoint or is advanced differently",
    "cursor": "the data cursor differs: data order is not a pure function of the saved state",
    "step": "the step counter differs",
    "frozen_base": "the frozen base model's identity differs (LoRA): another base was loaded",
}


def divergence_text(div: dict, after: str) -> str:
    """What a first divergence means, in words; ``after`` names the interruption."""
    parts = ", ".join(div.get("parts") or []) or "unknown part"
    if div.get("missing_in"):
        return (
            f"After the {after}, step {div['step']} is missing in the {div['missing_in']}: the "
            "runs cannot be compared there (see its run.json and logs)."
        )
    if div["what"] == "restored checkpoint":
        return (
            f"After the {after}, the state restored from the checkpoint at step {div['step']} "
            f"differs from the reference at that step (differing part(s): {parts}): the "
            "checkpoint does not hold the complete state it claims, or the reference is not "
            "reproducible."
        )
    why = "; ".join(_PART_HINTS.get(p, p + " differs") for p in (div.get("parts") or []))
    return (
        f"After the {after}, the resumed run diverged from the reference at step {div['step']} "
        f"(first differing part(s): {parts}) — {why}. A resumed training would not be the same "
        "computation; training is blocked until this is fixed."
    )


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
    return " ".join(texts[part](proof) for part in _parts(mode))


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
    supervision: supervisor.Settings = supervisor.QUALIFICATION,
    processes: int = 1,
) -> dict:
    """Run the recovery proof for ``recipe_path``; write and return ``proof.json``.

    Runs live under ``work_dir/qualification/<proof-id>/`` and are kept (logs,
    events, checkpoints). ``passed`` is False (never an exception) when recovery
    does not reproduce the reference; the diagnosis says why.
    """
    from .. import recipe as recipes

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
        runs = _Runs(
            recipe,
            Path(recipe_path),
            Path(input_root),
            Path(work_dir),
            base,
            steps=steps,
            examples_dir=examples_dir,
            supervision=supervision,
            processes=processes,
        )
        reference = run_reference(runs, proof)
        # A divergence in one part does not stop the other: both are evidence.
        if "crash" in _parts(mode):
            parts_passed.append(crash_part(runs, proof, reference, k))
        if "preempt" in _parts(mode):
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


# -- the verdict ---------------------------------------------------------------------------
def _obj(value: object) -> dict:
    return value if isinstance(value, dict) else {}


def _is_step(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _hash_map(value: object) -> dict[int, str] | None:
    """``[{step, state_hash}]`` as step → hash, or None when it is not such a list."""
    if not isinstance(value, list):
        return None
    out = {}
    for row in value:
        if not isinstance(row, dict) or not _is_step(row.get("step")):
            return None
        out[row["step"]] = row.get("state_hash")
    return out


def _same_path(a: object, b: object) -> bool:
    return isinstance(a, str) and isinstance(b, str) and os.path.normpath(a) == os.path.normpath(b)


def _steps_text(steps: list[int]) -> str:
    return ", ".join(map(str, steps[:10])) + (f" and {len(steps) - 10} more" if steps[10:] else "")


def _resumed_reasons(
    part: str,
    reference: dict[int, str] | None,
    resumed_record: object,
    used: dict,
    rows: object,
    steps: int,
) -> list[str]:
    """A resumed run against the reference, from the hashes both records hold."""
    reasons = []
    resumed, restored = _obj(resumed_record), _obj(_obj(resumed_record).get("restored"))
    start = restored.get("step")
    if not _is_step(start):
        return [f"{part}: the resumed run records no restored checkpoint"]
    if used.get("verified") is not True:
        reasons.append(f"{part}: the checkpoint used is not recorded as verified")
    if (
        start != used.get("step")
        or not restored.get("sha256")
        or (restored.get("sha256") != used.get("sha256"))
    ):
        reasons.append(
            f"{part}: the resumed run restored the checkpoint of step {start} (sha256 "
            f"{restored.get('sha256')}), not the verified one of step {used.get('step')} "
            f"(sha256 {used.get('sha256')})"
        )
    hashes = _hash_map(resumed.get("state_hashes"))
    if hashes is None:
        return [*reasons, f"{part}: the resumed run's state_hashes are missing or malformed"]
    if start >= steps:
        reasons.append(f"{part}: the restored step {start} leaves no update up to steps={steps}")
    elif not hashes.get(start + 1):
        reasons.append(
            f"{part}: the resumed run records no update {start + 1}, the step right after the "
            f"restored checkpoint (step {start})"
        )
    if reference is not None:
        if start > 0 and (
            not restored.get("state_hash") or restored.get("state_hash") != reference.get(start)
        ):
            reasons.append(
                f"{part}: the restored state hash {restored.get('state_hash')} differs from the "
                f"reference's at step {start} ({reference.get(start)})"
            )
        differ = [s for s in range(start + 1, steps + 1) if hashes.get(s) != reference.get(s)]
        if differ:
            reasons.append(
                f"{part}: the resumed run's state hash differs from the reference's (or is "
                f"missing) at step(s) {_steps_text(differ)}"
            )
    # the recorded comparison, judged by its own hashes (its ``equal`` flags are not read)
    if not isinstance(rows, list) or not rows:
        return [*reasons, f"{part}: the proof records no comparison"]
    unequal, covered, unhashed = [], set(), []
    for row in rows:
        row = _obj(row)
        step = row.get("step") if _is_step(row.get("step")) else -1
        covered.add(step)
        if not row.get("reference") or not row.get("resumed"):
            unhashed.append(step)
        agrees = reference is None or reference.get(step) == row.get("reference")
        if not row.get("reference") or row.get("reference") != row.get("resumed") or not agrees:
            unequal.append(step)
    if unhashed:
        reasons.append(
            f"{part}: the recorded comparison claims step(s) {_steps_text(unhashed)}, where the "
            f"reference or the resumed run recorded no state hash"
        )
    if unequal:
        reasons.append(
            f"{part}: the recorded comparison is not equal (or not the reference's hash) at "
            f"step(s) {_steps_text(unequal)}"
        )
    uncovered = [s for s in range(start + 1, steps + 1) if s not in covered]
    if uncovered:
        reasons.append(f"{part}: the recorded comparison omits step(s) {_steps_text(uncovered)}")
    return reasons


def _crash_reasons(proof: dict, reference: dict[int, str] | None, steps: int) -> list[str]:
    reasons = []
    k = _obj(proof.get("settings")).get("fail_after_step")
    faulted, used = _obj(proof.get("faulted")), _obj(proof.get("checkpoint_used"))
    if faulted.get("classification") != "failed" or faulted.get("last_update_step") != k:
        reasons.append(
            f"crash: the faulted run is not the injected crash after update {k} "
            f"(classification {faulted.get('classification')!r}, last update "
            f"{faulted.get('last_update_step')!r})"
        )
    if not _is_step(used.get("step")) or not _is_step(k) or used["step"] > k:
        reasons.append(f"crash: the checkpoint used ({used.get('step')!r}) is not at or before {k}")
    reasons += _resumed_reasons(
        "crash", reference, proof.get("resumed"), used, proof.get("comparison"), steps
    )
    if proof.get("first_divergence") is not None:
        reasons.append(f"crash: the proof records a divergence: {proof['first_divergence']!r}")
    return reasons


def _preempt_reasons(proof: dict, reference: dict[int, str] | None, steps: int) -> list[str]:
    section = proof.get("preempted")
    if not isinstance(section, dict):
        return ["preempt: the proof's mode includes a preemption, but it has no preempted section"]
    reasons = []
    k = _obj(proof.get("settings")).get("preempt_after_step")
    run, receipt = _obj(section.get("run")), _obj(section.get("receipt"))
    used = _obj(section.get("checkpoint_used"))
    if run.get("classification") != "preempted" or run.get("exit_code") != EXIT_PREEMPTED:
        reasons.append(
            f"preempt: the preempted run did not exit {EXIT_PREEMPTED} as preempted "
            f"(classification {run.get('classification')!r}, exit {run.get('exit_code')!r})"
        )
    if not _is_step(k) or receipt.get("step") != k:
        reasons.append(
            f"preempt: the receipt names the checkpoint of step {receipt.get('step')!r}, not the "
            f"step {k!r} the preemption came after"
        )
    restored = _obj(_obj(section.get("resumed")).get("restored"))
    for name, record in (
        ("checkpoint used", used),
        ("resumed run's restored checkpoint", restored),
    ):
        if (
            not receipt.get("sha256")
            or record.get("step") != receipt.get("step")
            or record.get("sha256") != receipt.get("sha256")
            or not _same_path(record.get("path"), receipt.get("path"))
        ):
            reasons.append(
                f"preempt: the {name} ({record.get('path')}, sha256 {record.get('sha256')}) is "
                f"not the one the receipt names ({receipt.get('path')}, sha256 "
                f"{receipt.get('sha256')})"
            )
    reasons += _resumed_reasons(
        "preempt", reference, section.get("resumed"), used, section.get("comparison"), steps
    )
    if section.get("first_divergence") is not None:
        reasons.append(f"preempt: the proof records a divergence: {section['first_divergence']!r}")
    if section.get("passed") is not True:
        reasons.append(f"preempt: the section does not say it passed ({section.get('passed')!r})")
    return reasons


def verdict(proof: object, computation_digest: str | None) -> list[str]:
    """Why ``proof`` is not acceptable evidence for ``computation_digest`` (empty: accepted).

    The one judgement of a proof document (training gate, publication, activation). It
    reads the document alone and recomputes every comparison from the state hashes it
    records: the reference's against each resumed run's, step by step from the restored
    checkpoint, and each recorded comparison row from its own two hashes. ``passed`` must
    agree with all of that; ``first_divergence`` and ``equal`` flags are not trusted, and a
    ``status`` field means nothing. A proof without ``settings.mode`` predates the
    preemption mode and is judged as a crash-only proof.
    """
    if not isinstance(proof, dict):
        return [f"the proof is not a JSON object (it is a {type(proof).__name__})"]
    if proof.get("format") != FORMAT:
        return [f"the document is not a recovery proof of format {FORMAT} "
                f"(format {proof.get('format')!r})"]  # fmt: skip
    reasons = []
    if proof.get("computation_digest") != computation_digest:
        reasons.append(
            f"the proof is of computation {proof.get('computation_digest')!r}, not "
            f"{computation_digest}"
        )
    settings = _obj(proof.get("settings"))
    mode, steps = settings.get("mode", LEGACY_MODE), settings.get("steps")
    if mode not in MODES or not _is_step(steps) or steps < 1:
        return [*reasons, f"the proof's settings are malformed (mode {mode!r}, steps {steps!r})"]
    # a proof from before the cadence existed hashed every update
    cadence = settings.get("state_hash_every", PROOF_HASH_EVERY)
    if cadence != PROOF_HASH_EVERY:
        reasons.append(
            f"the proof's runs recorded state hashes at cadence {cadence!r}, not after every "
            f"update: the updates between hashes are not compared"
        )
    reference = _hash_map(_obj(proof.get("reference")).get("state_hashes"))
    if reference is None:
        reasons.append("the reference run's state_hashes are missing or malformed")
    else:
        missing = [s for s in range(1, steps + 1) if not reference.get(s)]
        if missing:
            reasons.append(f"the reference records no state hash at step(s) {_steps_text(missing)}")
    if "crash" in _parts(mode):
        reasons += _crash_reasons(proof, reference, steps)
    if "preempt" in _parts(mode):
        reasons += _preempt_reasons(proof, reference, steps)
    if proof.get("problem") is not None:
        reasons.append(f"the proof records a problem: {proof['problem']}")
    if proof.get("passed") is not True:
        reasons.append(
            f"the proof does not say it passed (passed={proof.get('passed')!r}): "
            f"{proof.get('diagnosis')}"
        )
    elif reasons:
        reasons.append("it says passed: true, which its own records above contradict")
    return reasons
