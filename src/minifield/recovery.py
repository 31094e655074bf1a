"""Recovery proof: evidence that an interrupted and resumed run is the same computation.

A qualification is the recipe's own computation truncated to ``steps`` updates
(``--stop-after-step``: an operational limit, not part of the computation
digest). The proof runs, each under the supervisor:

1. an uninterrupted **reference** that records the complete-state hash (and one
   hash per state part) after every update;
2. a **faulted** run that hard-exits right after update ``k``
   (``--fail-after-step``); the proof confirms that process has exited and keeps
   its logs and attempt directory;
3. validation of the faulted run's **last committed checkpoint** (step ≤ k):
   every array's sha256, shape and dtype and the recomputed state hash;
4. a **resumed** run in a new attempt from that checkpoint.

It then compares the restored state, the next update and every later
complete-state hash with the reference. The first divergence names the step and
the state part(s) that differ. A plausible final loss is not evidence; equal
complete-state hashes are.
"""

from __future__ import annotations

import datetime as dt
import os
import time
from pathlib import Path
from typing import Any

from . import atomic, checkpoint, examples, inputs
from . import recipe as recipes
from . import supervise as supervisor
from .attempt_layout import CHECKPOINTS, EVENTS, RESULT
from .events import read as read_events

FORMAT = "minifield-proof/1"
PROOF_FILE = "proof.json"


def default_settings(recipe: recipes.Recipe) -> dict:
    """Qualification length and fault point derived from the recipe's checkpoint cadence.

    ``steps = min(max_steps, 2*every + 2)`` and ``k = every + 1``: the fault lands one
    update after the first checkpoint, so the resumed run must redo a lost update,
    cross a checkpoint written by the new attempt, and continue past it.
    """
    every = recipe.data["checkpoint"]["every_steps"]
    max_steps = recipe.data["limits"]["max_steps"]
    return {"steps": min(max_steps, 2 * every + 2), "fail_after_step": every + 1}


def settings_problem(recipe: recipes.Recipe, steps: int, k: int) -> str | None:
    every = recipe.data["checkpoint"]["every_steps"]
    max_steps = recipe.data["limits"]["max_steps"]
    if not 1 <= steps <= max_steps:
        return f"qualification steps={steps} must be between 1 and the recipe's limits.max_steps={max_steps}"
    if not 1 <= k < steps:
        return f"qualification fail_after_step={k} must be at least 1 and below steps={steps}"
    if k < every:
        return (
            f"qualification fail_after_step={k} is before the first checkpoint "
            f"(checkpoint.every_steps={every}): there would be no committed checkpoint to resume "
            f"from; choose fail_after_step >= {every}"
        )
    return None


def _process_exited(pid: int | None) -> bool:
    if pid is None:
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


def _updates(events: list[dict]) -> dict[int, dict]:
    return {e["step"]: e for e in events if e["type"] == "update"}


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
        "pid": outcome.get("pid"),
        "duration_s": outcome.get("duration_s"),
        "status": result.get("status") if result else None,
        "steps_completed": result.get("steps_completed") if result else None,
        "error": result.get("error") if result else None,
    }


def _manifest_part_diff(a: Path, b: Path) -> list[str]:
    """State parts whose arrays differ between two checkpoint manifests."""
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


def _diagnosis(proof: dict) -> str:
    div = proof["first_divergence"]
    ck = proof["checkpoint_used"]
    if proof["passed"]:
        n = proof["settings"]["steps"]
        return (
            f"Recovery reproduced the computation exactly: the run that crashed after update "
            f"{proof['settings']['fail_after_step']} was resumed in a new attempt from the verified "
            f"checkpoint at step {ck['step']}; the restored state, the next update (step "
            f"{ck['step'] + 1}) and every complete-state hash up to step {n} equal the "
            "uninterrupted reference."
        )
    if proof.get("problem"):
        return proof["problem"]
    if div is None:
        return "The proof could not be completed (see the run records)."
    parts = ", ".join(div.get("parts") or []) or "unknown part"
    if div.get("missing_in"):
        return (
            f"Step {div['step']} is missing in the {div['missing_in']}: the runs cannot be compared "
            "there (see its run.json and logs)."
        )
    if div["what"] == "restored checkpoint":
        return (
            f"The state restored from the checkpoint at step {div['step']} differs from the "
            f"reference at that step (differing part(s): {parts}): the checkpoint does not hold "
            "the complete state it claims, or the reference is not reproducible."
        )
    hint = {
        "params": "parameters differ: the update computation is not reproducible after a restore",
        "opt_state": "optimizer state differs: it is not fully saved or restored",
        "rng": "the random key differs: the RNG state is not part of the checkpoint or is advanced differently",
        "cursor": "the data cursor differs: data order is not a pure function of the saved state",
        "step": "the step counter differs",
    }
    why = "; ".join(hint.get(p, p + " differs") for p in (div.get("parts") or []))
    return (
        f"The resumed run diverged from the reference at step {div['step']} (first differing "
        f"part(s): {parts}) — {why}. A resumed training would not be the same computation; "
        "training is blocked until this is fixed."
    )


def prove(
    recipe_path: Path,
    input_root: Path,
    work_dir: Path,
    out_proof: Path | None = None,
    *,
    steps: int | None = None,
    fail_after_step: int | None = None,
    examples_dir: Path | None = None,
    deadline_s: float = 3600.0,
    stall_s: float = 600.0,
    grace_s: float = 30.0,
    env: dict | None = None,
    pass_fds: tuple[int, ...] = (),
    processes: int = 1,
) -> dict:
    """Run the recovery proof for ``recipe_path``; write and return ``proof.json``.

    Runs live under ``work_dir/qualification/<proof-id>/`` and are kept (logs,
    events, checkpoints). ``passed`` is False (never an exception) when recovery
    does not reproduce the reference; the diagnosis says why.
    """
    recipe = recipes.load(recipe_path)
    defaults = default_settings(recipe)
    steps = defaults["steps"] if steps is None else int(steps)
    k = defaults["fail_after_step"] if fail_after_step is None else int(fail_after_step)
    started = time.monotonic()
    proof_id = dt.datetime.now(dt.UTC).strftime("p%Y%m%dT%H%M%S%fZ")
    base = Path(work_dir) / "qualification" / proof_id
    out_root = base / "attempts"
    job_dir = out_root / recipe.job_id
    proof: dict[str, Any] = {
        "format": FORMAT,
        "passed": False,
        "computation_digest": recipe.computation_digest,
        "recipe": str(recipe_path),
        "strategy": {"name": recipe.strategy.name, "version": recipe.strategy.version},
        "settings": {
            "steps": steps,
            "fail_after_step": k,
            "every_steps": recipe.data["checkpoint"]["every_steps"],
            "max_steps": recipe.data["limits"]["max_steps"],
            "deadline_s": deadline_s,
            "stall_s": stall_s,
            "grace_s": grace_s,
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
        "problem": None,
        "created": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
    }

    def finish() -> dict:
        proof["diagnosis"] = _diagnosis(proof)
        proof["seconds"] = time.monotonic() - started
        atomic.write_json(base / PROOF_FILE, proof)
        if out_proof is not None:
            atomic.write_json(out_proof, proof)
        return proof

    base.mkdir(parents=True, exist_ok=True)
    problem = settings_problem(recipe, steps, k)
    if problem:
        proof["problem"] = problem
        return finish()

    common = ["--job", recipe_path, "--input-root", input_root, "--output-root", out_root]
    common += ["--stop-after-step", str(steps), "--record-state-hashes"]
    # Shared with training: the proof's three runs compile once, and the proof then also covers
    # a resume that loads its executable from the persistent cache.
    common += ["--compilation-cache", Path(work_dir) / "jax-cache"]
    if examples_dir is not None:
        common += ["--examples", examples_dir]

    def launch(name: str, *extra: str | Path) -> tuple[dict, Path]:
        outcome = supervisor.supervise(
            supervisor.worker_command(*common, "--attempt-id", name, *extra, processes=processes),
            base / "runs" / name,
            deadline_s=deadline_s,
            stall_s=stall_s,
            grace_s=grace_s,
            env=env,
            pass_fds=pass_fds,
        )
        return outcome, job_dir / name

    # 1. uninterrupted reference
    ref_outcome, ref_dir = launch("reference")
    proof["reference"] = _run_record(ref_outcome, ref_dir)
    ref_updates = _updates(read_events(ref_dir / EVENTS)[0]) if ref_dir.is_dir() else {}
    proof["reference"]["state_hashes"] = [
        {"step": s, "state_hash": ref_updates[s].get("state_hash")} for s in sorted(ref_updates)
    ]
    if proof["reference"]["steps_completed"] != steps or sorted(ref_updates) != list(
        range(1, steps + 1)
    ):
        proof["problem"] = (
            f"The uninterrupted reference did not complete {steps} updates "
            f"({ref_outcome['classification']}: {ref_outcome['reason']}; worker status "
            f"{proof['reference']['status']}, error {proof['reference']['error']}); see "
            f"{ref_outcome['stderr_log']}"
        )
        return finish()

    # 2. the same computation, crashing hard right after update k
    fault_outcome, fault_dir = launch("faulted", "--fail-after-step", str(k))
    faulted = _run_record(fault_outcome, fault_dir)
    faulted["exited"] = _process_exited(fault_outcome.get("pid"))
    fault_updates = _updates(read_events(fault_dir / EVENTS)[0]) if fault_dir.is_dir() else {}
    faulted["last_update_step"] = max(fault_updates, default=0)
    faulted["state_hashes"] = [
        {"step": s, "state_hash": fault_updates[s].get("state_hash")} for s in sorted(fault_updates)
    ]
    proof["faulted"] = faulted
    if not faulted["exited"] or fault_outcome["classification"] == "completed":
        proof["problem"] = (
            f"The faulted run did not end as a crash (classification "
            f"{fault_outcome['classification']}, exited={faulted['exited']})"
        )
        return finish()
    if faulted["last_update_step"] != k:
        proof["problem"] = (
            f"The faulted run's last update is step {faulted['last_update_step']}, expected the "
            f"injected fault right after update {k}; see {fault_outcome['stderr_log']}"
        )
        return finish()

    # 3. validate the last committed checkpoint, independently of the worker
    ckpt_root = fault_dir / CHECKPOINTS
    committed = checkpoint.committed_steps(ckpt_root)
    if not committed:
        proof["problem"] = f"The faulted run left no committed checkpoint in {ckpt_root}"
        return finish()
    last = committed[-1]
    path = ckpt_root / checkpoint.step_dir_name(last)
    record = {"step": last, "path": str(path), "sha256": checkpoint.manifest_sha256(path)}
    proof["checkpoint_used"] = record
    if last > k:
        proof["problem"] = f"Checkpoint step {last} is after the fault at update {k}"
        return finish()
    if examples_dir is not None:
        arrays, _ = examples.load(examples_dir, recipe.examples_digest)
    else:
        arrays, _ = recipe.strategy.prepare(
            recipe.data, inputs.files_by_name(recipe.data, input_root)
        )
    program = recipe.strategy.build(recipe.data, arrays)
    try:
        _, manifest = checkpoint.load(
            path, program.init_state(), computation_digest=recipe.computation_digest
        )
    except checkpoint.CheckpointError as exc:
        record["verified"] = False
        proof["problem"] = f"The last committed checkpoint does not verify: {exc}"
        return finish()
    record["verified"] = True
    record["state_hash"] = manifest["state_hash"]

    # 4. resume in a new attempt
    res_outcome, res_dir = launch("resumed", "--resume-from", fault_dir)
    resumed = _run_record(res_outcome, res_dir)
    res_events = read_events(res_dir / EVENTS)[0] if res_dir.is_dir() else []
    restored = next((e for e in res_events if e["type"] == "restored"), None)
    res_updates = _updates(res_events)
    resumed["restored"] = (
        {k2: restored.get(k2) for k2 in ("step", "path", "sha256", "state_hash")}
        if restored
        else None
    )
    resumed["state_hashes"] = [
        {"step": s, "state_hash": res_updates[s].get("state_hash")} for s in sorted(res_updates)
    ]
    proof["resumed"] = resumed
    if restored is None:
        proof["problem"] = (
            f"The resumed run did not restore a checkpoint ({res_outcome['classification']}: "
            f"{resumed['error'] or res_outcome['reason']}); see {res_outcome['stderr_log']}"
        )
        return finish()
    if restored["step"] != last or restored["sha256"] != record["sha256"]:
        proof["problem"] = (
            f"The resumed run restored checkpoint step {restored['step']} ({restored['path']}), "
            f"not the validated one at step {last}"
        )
        return finish()

    result = compare(
        ref_updates,
        res_updates,
        restored_step=last,
        restored_state_hash=restored.get("state_hash"),
        steps=steps,
    )
    div = result["first_divergence"]
    if div is not None and div["what"] == "restored checkpoint":
        ref_ckpt = ref_dir / CHECKPOINTS / checkpoint.step_dir_name(last)
        if (ref_ckpt / checkpoint.MANIFEST).is_file():
            div["parts"] = _manifest_part_diff(ref_ckpt, path)
    proof["comparison"] = result["rows"]
    proof["next_update"] = result["next_update"]
    proof["first_divergence"] = div
    proof["passed"] = (
        div is None
        and resumed["steps_completed"] == steps
        and all(r["equal"] for r in result["rows"])
        and len(result["rows"]) >= steps - last
    )
    return finish()


def verdict(proof: Any, computation_digest: str | None) -> list[str]:
    """Why ``proof`` does not qualify ``computation_digest``; an empty list accepts it.

    Provisional: written in the store branch so publication and activation can call the
    single verdict; the proof branch replaces it. The verdict is recomputed from the hashes
    the proof records, not taken from its ``passed`` field alone.
    """
    if not isinstance(proof, dict):
        return ["the proof is not a JSON object"]
    reasons = []
    if proof.get("computation_digest") != computation_digest:
        reasons.append(
            f"the proof is of computation {proof.get('computation_digest')!r}, "
            f"not of this one ({computation_digest!r})"
        )
    if proof.get("passed") is not True:
        reasons.append(
            f"the proof did not pass (passed={proof.get('passed')!r}): {proof.get('diagnosis')!r}"
        )

    def hashes(run: Any) -> dict:
        rows = run.get("state_hashes") if isinstance(run, dict) else None
        if not isinstance(rows, list):
            return {}
        return {r.get("step"): r.get("state_hash") for r in rows if isinstance(r, dict)}

    reference, resumed = hashes(proof.get("reference")), hashes(proof.get("resumed"))
    restored = (proof.get("resumed") or {}).get("restored") or {}
    restored_step = restored.get("step")
    steps = (proof.get("settings") or {}).get("steps")
    if not isinstance(restored_step, int) or not isinstance(steps, int):
        return [
            *reasons,
            "the proof records no restored checkpoint step or no qualification length",
        ]
    if not restored_step < steps <= len(reference):
        return [
            *reasons,
            f"the proof's reference records {len(reference)} state hashes for a qualification of "
            f"{steps} updates resumed after step {restored_step}",
        ]
    if restored_step > 0 and restored.get("state_hash") != reference.get(restored_step):
        reasons.append(
            f"the restored checkpoint's state hash at step {restored_step} differs from the "
            "reference's"
        )
    for step in range(restored_step + 1, steps + 1):
        if resumed.get(step) is None or reference.get(step) is None:
            which = "resumed run" if resumed.get(step) is None else "reference"
            first = " (the first update after the restored checkpoint)"
            reasons.append(
                f"step {step} is missing in the {which}"
                + (first if step == restored_step + 1 else "")
            )
        elif resumed[step] != reference[step]:
            reasons.append(
                f"step {step}: the resumed state hash {resumed[step]} differs from the "
                f"reference's {reference[step]}"
            )
    return reasons
