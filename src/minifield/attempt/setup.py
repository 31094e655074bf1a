"""Everything an attempt does before its first update, and the processes' agreement on it.

:func:`open_directory` creates the attempt's fresh directory (process 0) and tells every
process its id. :func:`set_up` then writes ``attempt.json``, checks the previous attempt
and the devices, verifies the inputs, loads the examples, compiles the update and restores
the newest valid checkpoint; it never raises, but says what to do next as one of three
outcomes. :func:`agree` makes every process of a multi-process attempt act on the same one.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .. import atomic
from ..hf import quantized_base
from ..inputs import examples, pinned
from ..recipe import Recipe
from ..state.checkpoint import CheckpointRecord
from ..supervision import distributed
from . import device_check, resume
from .events import EventLog
from .layout import ATTEMPT_JSON, RESERVE, new_attempt_id
from .result import EXIT_FAILED, EXIT_INVALID, EXIT_IO, AttemptError, Progress
from .resume import ResumeRefused


@dataclass(frozen=True)
class SetUpContext:
    """What set-up reads of the attempt (its directory is open, its event log too)."""

    recipe: Recipe
    attempt_id: str
    directory: Path
    env: dict[str, Any]  # the environment fingerprint
    started: str
    group: distributed.Group
    input_root: Path
    examples_dir: Path | None
    quantized_base_dir: Path | None
    resume_from: Path | None
    allow_environment_change: bool
    compilation_cache: Path | None
    events: EventLog
    progress: Progress  # set-up fills in inputs, steps completed and the environment override
    say: Callable[[str], None]


@dataclass(frozen=True)
class SetUpFailed:
    error: AttemptError
    #: EXIT_INVALID for a refused job, inputs or resume; EXIT_IO when the output could not be
    #: written; EXIT_FAILED otherwise
    code: int


@dataclass(frozen=True)
class AdoptCompleted:
    """The previous attempt completed the computation: report its result, train nothing."""

    previous: resume.Completed


@dataclass(frozen=True)
class ReadyToTrain:
    program: Any  # strategies.base.Program, compiled
    state: Any  # host arrays (restored or fresh), not yet placed on the devices
    step: int
    restored: CheckpointRecord | None
    compute_before: float
    #: the restored state was read by slices: its hash is checked once placed
    #: (``checkpoint.verify_placed``)
    restored_sliced: bool = False


SetUp = SetUpFailed | AdoptCompleted | ReadyToTrain


def _choose_attempt_id(job_dir: Path, given: str | None, wanted: str | None, resuming: bool) -> str:
    if given:
        return given
    if wanted and not (job_dir / wanted).exists():
        return wanted
    if wanted and not resuming:
        raise ResumeRefused(
            f"attempt directory {job_dir / wanted} already exists: every execution needs a fresh "
            "attempt_id (omit attempt_id from the recipe, or pass --attempt-id)"
        )
    return new_attempt_id()


def open_directory(
    job_dir: Path,
    *,
    given_id: str | None,
    recipe_id: str | None,
    resuming: bool,
    group: distributed.Group,
) -> tuple[str, Path]:
    """Process 0 creates the attempt directory; every process learns its id from it.

    Raises ResumeRefused when the directory exists already (every execution gets a fresh one)
    or process 0 could not create it.
    """
    failure, message = None, ""
    if group.is_writer:
        try:
            job_dir.mkdir(parents=True, exist_ok=True)
            attempt_id = _choose_attempt_id(job_dir, given_id, recipe_id, resuming)
            try:
                (job_dir / attempt_id).mkdir()
            except FileExistsError:
                raise ResumeRefused(
                    f"attempt directory {job_dir / attempt_id} already exists: every "
                    "execution needs a fresh attempt_id"
                ) from None
            message = f"ok:{attempt_id}"
        except (ResumeRefused, OSError) as exc:
            failure, message = exc, f"error:{exc}"
    kind, _, text = group.broadcast_text(message).partition(":")
    if failure is not None:
        raise failure
    if kind != "ok":
        raise ResumeRefused(f"process 0 could not open the attempt: {text}")
    return text, job_dir / text


#: what the attempt's last words take at most (the final event and result.json, a few KiB)
RESERVE_BYTES = 64 << 10


def hold_reserve(directory: Path) -> None:
    """Set :data:`RESERVE_BYTES` aside in ``directory``: when another process fills the disk,
    :func:`release_reserve` gives them back for the final event and ``result.json``."""
    path = directory / RESERVE
    with atomic.naming(path):
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.posix_fallocate(fd, 0, RESERVE_BYTES)
        finally:
            os.close(fd)


def release_reserve(directory: Path) -> None:
    (directory / RESERVE).unlink(missing_ok=True)


def _write_attempt_json(context: SetUpContext, compute_before: float) -> None:
    recipe, group = context.recipe, context.group
    atomic.write_json(
        context.directory / ATTEMPT_JSON,
        {
            "job_id": recipe.data["job_id"],
            "attempt_id": context.attempt_id,
            "computation_digest": recipe.computation_digest,
            "examples_digest": recipe.examples_digest,
            "resumed_from": str(context.resume_from.resolve()) if context.resume_from else None,
            "compute_seconds_before": compute_before,
            "environment": context.env,
            "environment_override": context.progress.environment_override,
            "processes": {
                "count": group.size,
                "source": group.topology.source,
                "coordinator": group.topology.coordinator,
            },
            "started": context.started,
        },
    )


def set_up(context: SetUpContext) -> SetUp:
    """Everything before the first update; returns what to do next (never raises)."""
    recipe, events, progress = context.recipe, context.events, context.progress
    data = recipe.data
    phase = "start"
    try:
        previous = None
        if context.resume_from:
            previous = resume.check(
                context.resume_from,
                computation_digest=recipe.computation_digest,
                env=context.env,
                allow_environment_change=context.allow_environment_change,
            )
            progress.environment_override = previous.environment_override
        compute_before = resume.compute_seconds(context.resume_from) if previous else 0.0
        if context.group.is_writer:
            _write_attempt_json(context, compute_before)
        events.emit(
            "attempt_started",
            job_id=data["job_id"],
            attempt_id=context.attempt_id,
            computation_digest=recipe.computation_digest,
            resumed_from=str(context.resume_from) if context.resume_from else None,
            environment_override=progress.environment_override,
        )
        phase = "device"
        device_check.check(recipe, context.env, context.group, events)
        if previous is not None:
            done = resume.completed(previous.directory)
            if done is not None:
                return AdoptCompleted(done)

        phase = "inputs"
        verified = pinned.verify(data, context.input_root)
        progress.inputs = [
            {"name": v["name"], "path": v["path"], "sha256": v["sha256"]} for v in verified
        ]
        events.emit("inputs_verified", inputs=progress.inputs)

        phase = "examples"
        if context.examples_dir is not None:
            example_arrays, _ = examples.load(context.examples_dir, recipe.examples_digest)
        else:
            example_arrays, _ = recipe.strategy.prepare(
                data, pinned.files_by_name(data, context.input_root)
            )
        if context.quantized_base_dir is not None:  # its codes beside the stored base
            phase = "quantized base"
            product = quantized_base.load(context.quantized_base_dir, data)
            example_arrays = {**example_arrays, **product}

        phase = "compile"
        program = recipe.strategy.build(data, example_arrays)
        if context.group.is_writer:
            program.attach(context.directory)
        started = time.monotonic()
        program.compile()
        events.emit(
            "compiled",
            seconds=time.monotonic() - started,
            compilation_cache=str(context.compilation_cache) if context.compilation_cache else None,
            placement=program.placement,
            attention=program.attention,
            memory=program.memory,
            memory_plan=program.memory_plan,
        )

        phase = "restore"
        restored = None
        if previous is not None:
            restored = resume.restore(
                previous.directory,
                program.state_template(),
                computation_digest=recipe.computation_digest,
                events=events,
                say=context.say,
            )
        state = restored.state if restored else program.init_state()
        step = int(state["step"])
        progress.steps_completed = step
        return ReadyToTrain(
            program,
            state,
            step,
            restored.checkpoint if restored else None,
            compute_before,
            restored_sliced=bool(restored and restored.sliced),
        )
    except ResumeRefused as exc:
        return SetUpFailed(AttemptError("resume", str(exc)), EXIT_INVALID)
    except (pinned.InputError, examples.ExamplesError) as exc:
        return SetUpFailed(AttemptError(phase, str(exc)), EXIT_INVALID)
    except Exception as exc:  # noqa: BLE001 - every failure must end in a result.json
        code = EXIT_IO if atomic.is_io_failure(exc) else EXIT_FAILED
        return SetUpFailed(AttemptError(phase, f"{type(exc).__name__}: {exc}"), code)


def _kind(outcome: SetUp) -> str:
    return {SetUpFailed: "failed", AdoptCompleted: "adopt", ReadyToTrain: "train"}[type(outcome)]


def agree(outcome: SetUp, group: distributed.Group) -> SetUp:
    """All processes start training from the same checkpoint, or none does.

    A process that failed set-up (inputs it cannot read, a checkpoint it cannot see)
    fails every process, with its own error named, instead of leaving the others
    waiting in the first collective of the update.
    """
    if group.size == 1:
        return outcome
    failed = outcome if isinstance(outcome, SetUpFailed) else None
    ready = outcome if isinstance(outcome, ReadyToTrain) else None
    mine = {
        "kind": _kind(outcome),
        "code": failed.code if failed else None,
        "phase": failed.error.phase if failed else None,
        "message": failed.error.message[:600] if failed else "",
        "step": ready.step if ready else None,
        "checkpoint": ready.restored.sha256 if ready and ready.restored else None,
    }
    reports = [json.loads(text) for text in group.gather_texts(json.dumps(mine))]
    if failed:
        return outcome
    for rank, report in enumerate(reports):
        if report["kind"] == "failed":
            return SetUpFailed(
                AttemptError(report["phase"], f"process {rank} failed: {report['message']}"),
                report["code"],
            )
    starts = {(r["kind"], r["step"], r["checkpoint"]) for r in reports}
    if len(starts) > 1:
        seen = "; ".join(
            f"process {rank}: {r['kind']} at step {r['step']} from checkpoint {r['checkpoint']}"
            for rank, r in enumerate(reports)
        )
        return SetUpFailed(
            AttemptError(
                "restore",
                f"the processes would start from different states ({seen}); "
                "every process must see the same output root (a shared filesystem)",
            ),
            EXIT_FAILED,
        )
    return outcome
