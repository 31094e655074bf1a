"""The proof's runs: each a real worker under the supervisor, in one proof directory.

Each step records its evidence in the proof document first, then raises
:class:`ProofProblem` if the run did not go as designed: the **reference** (uninterrupted,
every update's complete-state hash and per-part hashes), the **faulted** run (a hard exit
right after update ``k``) and its last committed checkpoint, the **preempted** run (the
supervisor's SIGTERM after update ``k``) and its durable receipt, the checkpoint verified
independently of the worker, and the **resumed** run that must restore exactly it.
"""

from __future__ import annotations

from pathlib import Path

from .. import atomic
from ..attempt.chain import committed_checkpoints
from ..attempt.events import read as read_events
from ..attempt.layout import ATTEMPT_JSON, CHECKPOINTS, EVENTS, RESULT
from ..attempt.options import computation_cache
from ..supervision import supervise as supervisor
from .document import EXIT_FAILED, EXIT_PREEMPTED, PREEMPT_HOLD_S, PROOF_HASH_EVERY


class ProofProblem(Exception):
    """The proof could not be carried out as designed; the message becomes ``problem``."""


def _updates(events: list[dict]) -> dict[int, dict]:
    return {e["step"]: e for e in events if e["type"] == "update"}


def _record_hashes(record: dict, updates: dict[int, dict]) -> None:
    """The run's per-update state hashes, and the one version they are of (an update event
    without ``state_hash_version`` predates the versions: 1; None when none is hashed)."""
    record["state_hashes"] = [
        {"step": s, "state_hash": updates[s].get("state_hash")} for s in sorted(updates)
    ]
    versions = {e.get("state_hash_version", 1) for e in updates.values() if e.get("state_hash")}
    record["state_hash_version"] = versions.pop() if len(versions) == 1 else None


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


def require_device(record: dict, name: str) -> None:
    """A run that never got the accelerator (``device_busy``) is said as such, before any
    reading of what it trained (nothing) could blame the recovery."""
    if record["status"] == "device_busy":
        raise ProofProblem(
            f"The {name} run could not get the accelerator, so the recovery was not tested: "
            f"{(record['error'] or {}).get('message')}; see {record['stderr_log']}"
        )


class Runs:
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
        quantized_base_dir: Path | None = None,
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
            "--compilation-cache", computation_cache(work_dir),
        ]  # fmt: skip
        if examples_dir is not None:
            self.common += ["--examples", examples_dir]
        self.quantized_base_dir = quantized_base_dir
        if quantized_base_dir is not None:
            self.common += ["--quantized-base", quantized_base_dir]
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
            if self.quantized_base_dir is not None:
                from ..hf import quantized_base

                arrays = {**arrays, **quantized_base.load(self.quantized_base_dir, recipe.data)}
            self._program = recipe.strategy.build(recipe.data, arrays)
        return self._program


def run_reference(runs: Runs, proof: dict) -> dict[int, dict]:
    """The uninterrupted reference; returns its update events by step."""
    outcome, attempt_dir, events = runs.launch("reference")
    record = proof["reference"] = _run_record(outcome, attempt_dir)
    require_device(record, "uninterrupted reference")
    updates = _updates(events)
    _record_hashes(record, updates)
    steps = runs.steps
    if record["steps_completed"] != steps or sorted(updates) != list(range(1, steps + 1)):
        raise ProofProblem(
            f"The uninterrupted reference did not complete {steps} updates "
            f"({outcome['classification']}: {outcome['reason']}; worker status "
            f"{record['status']}, error {record['error']}); see {outcome['stderr_log']}"
        )
    return updates


def run_faulted(runs: Runs, proof: dict, k: int) -> Path:
    """The same computation crashing hard right after update ``k``; returns its attempt dir."""
    outcome, attempt_dir, events = runs.launch("faulted", "--fail-after-step", str(k))
    record = proof["faulted"] = _run_record(outcome, attempt_dir)
    require_device(record, "faulted")
    # The supervisor reaped the child itself (exit_code is its wait status): that, not a
    # later look at the pid (which another process may have taken by then), shows it ended.
    record["exited"] = outcome["exit_code"] is not None
    updates = _updates(events)
    record["last_update_step"] = max(updates, default=0)
    _record_hashes(record, updates)
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

    # the faulted run is a fresh attempt: its chain is itself
    last, path = next(committed_checkpoints(attempt_dir), (None, None))
    if path is None:
        raise ProofProblem(
            f"The faulted run left no committed checkpoint in {attempt_dir / CHECKPOINTS}"
        )
    record = proof["checkpoint_used"] = checkpoint.CheckpointRecord(
        last, str(path), checkpoint.manifest_sha256(path)
    ).as_dict()
    if last > k:
        raise ProofProblem(f"Checkpoint step {last} is after the fault at update {k}")
    return record


def run_preempted(runs: Runs, section: dict, k: int) -> Path:
    """The same computation preempted by the supervisor's SIGTERM after update ``k``.

    Returns its attempt dir; ``section["receipt"]`` is what the worker left behind: the
    checkpoint its ``preempted`` event and its ``result.json`` name (they must agree).
    """
    outcome, attempt_dir, events = runs.launch(
        "preempted",
        *("--stall-after-step", str(k), "--stall-seconds", str(PREEMPT_HOLD_S)),
        "--stall-ends-on-stop",  # the hold ends as the SIGTERM lands: no idle seconds after it
        preempt_after_step=k,
    )
    record = section["run"] = _run_record(outcome, attempt_dir)
    require_device(record, "preempted")
    record["termination_by"] = (outcome.get("termination") or {}).get("by")
    updates = _updates(events)
    record["last_update_step"] = max(updates, default=0)
    _record_hashes(record, updates)
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
    sha256 = checkpoint.manifest_sha256(path) if path.is_dir() else None
    record = section["checkpoint_used"] = checkpoint.CheckpointRecord(
        receipt["step"], receipt["path"], sha256
    ).as_dict()
    if record["sha256"] != receipt["sha256"]:
        raise ProofProblem(
            f"The checkpoint the receipt names ({path}) has manifest sha256 "
            f"{record['sha256']}, the receipt says {receipt['sha256']}"
        )
    return record


def verify_checkpoint(runs: Runs, record: dict) -> None:
    """Load the checkpoint ``record`` names and check every array and the state hash."""
    from ..state import checkpoint

    try:
        _, manifest = checkpoint.load(
            Path(record["path"]),
            runs.program().state_template(),
            computation_digest=runs.recipe.computation_digest,
        )
    except checkpoint.CheckpointError as exc:
        record["verified"] = False
        raise ProofProblem(f"The checkpoint {record['path']} does not verify: {exc}") from exc
    record["verified"] = True
    record["state_hash"] = manifest["state_hash"]
    record["state_hash_version"] = manifest.get("state_hash_version", 1)


def run_resumed(
    runs: Runs, section: dict, name: str, from_dir: Path, expected: dict
) -> dict[int, dict]:
    """A new attempt resuming from ``from_dir``; it must restore the ``expected`` checkpoint.

    What it restored is read from its own records (``attempt.json``, its ``restored``
    event). Returns its update events by step.
    """
    outcome, attempt_dir, events = runs.launch(name, "--resume-from", from_dir)
    record = section["resumed"] = _run_record(outcome, attempt_dir)
    require_device(record, "resumed")
    info_path = attempt_dir / ATTEMPT_JSON
    info = atomic.read_json(info_path) if info_path.is_file() else {}
    record["resumed_from"] = info.get("resumed_from")
    restored = next((e for e in events if e["type"] == "restored"), None)
    record["restored"] = (
        {key: restored.get(key) for key in ("step", "path", "sha256", "state_hash")}
        | {"state_hash_version": restored.get("state_hash_version", 1)}
        if restored
        else None
    )
    updates = _updates(events)
    _record_hashes(record, updates)
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
