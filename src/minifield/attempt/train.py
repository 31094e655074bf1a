"""One training attempt: open its directory, set up, run the update loop, end with a result.

An attempt writes only into its own fresh directory ``OUT/<job_id>/<attempt_id>/`` (the
files are named in :mod:`~minifield.attempt.layout`). Resuming reads a previous attempt
directory (and, through ``attempt.json``, the chain of attempts before it) and never
writes into it.

This module is the orchestrator; each concern has its own module in this package (the
README's module map names them).

A multi-process attempt (:mod:`minifield.supervision.distributed`) runs this same program in
every process, each on its part of the device mesh. Only process 0 writes: the
attempt directory, ``attempt.json``, events, checkpoints (the state is brought to
the host collectively, then committed once), the export and ``result.json``. What
is not a pure function of the recipe is decided together (:class:`~minifield.
distributed.Group`): the attempt id, the outcome of set-up, and whether a signal or
a time limit stops the run before the next update.
"""

from __future__ import annotations

import shutil
import sys
import time
from pathlib import Path
from typing import NamedTuple

from .. import atomic
from ..recipe import Recipe
from ..state import export
from . import completion, device_claim, endings, resume
from . import result as attempt_result
from . import setup as attempt_setup
from .checkpoint_cadence import CheckpointCadence, fault_hook
from .checkpoint_writer import CheckpointWriteError
from .events import EventLog, write_line
from .faults import Faults
from .layout import CHECKPOINTS, EVENTS, EXPORT, RESULT
from .options import Options, enable_compilation_cache
from .result import (
    EXIT_COMPLETED,
    EXIT_FAILED,
    EXIT_INVALID,
    EXIT_IO,
    EXIT_LIMIT,
    EXIT_PREEMPTED,
    AttemptError,
    Ending,
    Progress,
)
from .resume import ResumeRefused
from .setup import AdoptCompleted, SetUpFailed, new_attempt_id
from .stopping import Stopping
from .update_loop import (
    Diverged,
    HostSnapshot,
    Stopped,
    UpdateLoop,
    periodic_evaluation,
)

__all__ = [
    "EXIT_COMPLETED",
    "EXIT_FAILED",
    "EXIT_INVALID",
    "EXIT_IO",
    "EXIT_LIMIT",
    "EXIT_PREEMPTED",
    "Attempt",
    "Faults",
    "Options",
    "ResumeRefused",
    "enable_compilation_cache",
    "new_attempt_id",
    "run",
]


class Attempt:
    def __init__(self, recipe: Recipe, options: Options):
        self.recipe = recipe
        self.options = options
        #: the environment fingerprint, taken once the backend is started (:meth:`run`)
        self.env: dict = {}
        self.started = attempt_result.now_iso()
        self.progress = Progress()
        self.stopping = Stopping(
            recipe.data["limits"],
            stop_after_step=options.stop_after_step,
            group=options.group,
            started_mono=time.monotonic(),
        )

    def open(self) -> None:
        """Create the attempt directory (process 0) and what writes into it."""
        group = self.options.group
        self.attempt_id, self.dir = attempt_setup.open_directory(
            self.options.output_root / self.recipe.data["job_id"],
            given_id=self.options.attempt_id,
            recipe_id=self.recipe.data.get("attempt_id"),
            resuming=self.options.resume_from is not None,
            group=group,
        )
        try:
            if group.is_writer:
                attempt_setup.hold_reserve(self.dir)
            self.events = (
                EventLog(self.dir / EVENTS, on_echo_closed=self._stdout_closed)
                if group.is_writer
                else EventLog(None, None)
            )
        except OSError:
            # nothing of the attempt is written yet: leave no directory that looks like one
            shutil.rmtree(self.dir, ignore_errors=True)
            raise
        # one host copy per step, shared by the update's state hash and a checkpoint
        self.snapshot = HostSnapshot()
        self.checkpoints = CheckpointCadence(
            self.dir / CHECKPOINTS,
            computation_digest=self.recipe.computation_digest,
            attempt_id=self.attempt_id,
            every_steps=self.recipe.data["checkpoint"]["every_steps"],
            max_steps=self.recipe.data["limits"]["max_steps"],
            keep=self.recipe.data["checkpoint"]["keep"],
            group=group,
            events=self.events,
            faults=self.options.faults,
            snapshot=self.snapshot,
        )

    def say(self, message: str) -> None:
        """One line on stderr for people; a closed stderr silences it and nothing else."""
        rank = self.options.group.rank
        write_line(sys.stderr, f"minifield-worker{f'[{rank}]' if rank else ''}: {message}")

    def _stdout_closed(self, reason: str) -> None:
        # nobody reads the live stream any more (a pipe's reader ended, a supervisor died):
        # the events file goes on as the record; stop as on a signal, with a checkpoint
        self.stopping.preemption.reader_gone(reason)
        self.say(f"{reason}; stopping before the next update (events: {self.dir / EVENTS})")

    def run(self) -> int:
        self.stopping.preemption.install()
        busy, self.env = device_claim.claim_for_attempt(self.recipe, self.stopping, self.events)
        if busy is not None:
            return self._finish(busy)
        outcome = attempt_setup.agree(
            attempt_setup.set_up(_setup_context(self)), self.options.group
        )
        if isinstance(outcome, SetUpFailed):
            if outcome.code == EXIT_IO:
                return self._finish(Ending.io_failed(outcome.error))
            return self._finish(Ending.failed(outcome.error, outcome.code))
        try:
            if isinstance(outcome, AdoptCompleted):
                self.checkpoints.newest = resume.adopt(
                    outcome.previous, self.dir if self.options.group.is_writer else None,
                    self.progress, self.events,
                )  # fmt: skip
                ending = Ending.completed()
            else:
                ending = self._train(outcome)
        except CheckpointWriteError as exc:
            self._settle_checkpoints()
            ending = _failure(AttemptError("checkpoint", str(exc)), exc)
        except export.ExportWriteError as exc:
            ending = _failure(AttemptError("export", str(exc)), exc)
        except Diverged as exc:
            self._settle_checkpoints()
            ending = endings.diverged(exc, self.checkpoints.newest, self.events, self.say)
        except Exception as exc:  # noqa: BLE001 - every failure must end in a result.json
            self._settle_checkpoints()
            ending = _failure(AttemptError("train", f"{type(exc).__name__}: {exc}"), exc)
        return self._finish(ending)

    def _settle_checkpoints(self) -> None:
        """On a failure, let a background write in flight end (and report it) before the
        attempt's last event, so that nothing is written after ``result.json``.

        Never raises: it runs inside the handling of the failure that ends the attempt, and
        anything escaping from there would skip :meth:`_finish`, leaving no ``result.json``.
        That failure may be the events file itself (full, at its size limit): the
        ``checkpoint_committed`` event of a write that did commit is then refused too. The
        commit still counts (``newest``, hence result.json, names it; a resume finds it on
        disk); what was not written is said on stderr."""
        try:
            self.checkpoints.wait(together=False)  # the failure may be this process's alone
        except CheckpointWriteError as exc:
            self.say(str(exc))
        except Exception as exc:  # noqa: BLE001 - the failure being handled ends the attempt
            newest = self.checkpoints.newest
            self.say(
                f"a checkpoint's event was not written ({type(exc).__name__}: {exc}); the "
                f"newest committed checkpoint is {newest.path if newest else None}"
            )

    def _train(self, ready: attempt_setup.ReadyToTrain) -> Ending:
        program = ready.program
        max_steps = self.recipe.data["limits"]["max_steps"]
        self.checkpoints.newest = ready.restored
        commit_on_cadence, collect_commits = self.checkpoints.hooks()
        loop = UpdateLoop(
            program,
            max_steps=max_steps,
            stopping=self.stopping,
            events=self.events,
            progress=self.progress,
            hooks=[
                fault_hook(
                    self.options.faults,
                    self.checkpoints,
                    lambda: self.stopping.preemption.signal is not None,
                ),
                commit_on_cadence,
                periodic_evaluation(program, self.events, max_steps),
                collect_commits,  # last: it reports what the hooks before it started
            ],
            record_state_hashes=self.options.record_state_hashes,
            say=self.say,
            snapshot=self.snapshot,
        )
        # restored arrays come from host files: put them where the compiled update wants
        # them (over several processes a collective, hence only once all agreed to start)
        state = program.place(ready.state)
        if ready.restored_sliced:  # each process read only its own slices: hash them placed
            from ..state import checkpoint

            checkpoint.verify_placed(state, ready.restored.path, ready.restored.state_hash)
        end = loop.run(state, ready.step, ready.compute_before)
        committed = self.checkpoints.ensure(end.state, end.step, end.compute_used)
        if isinstance(end, Stopped):
            return endings.stopped(end, committed, self.events)
        return completion.complete(
            program,
            end.state,
            end.step,
            group=self.options.group,
            events=self.events,
            progress=self.progress,
            snapshot=self.snapshot,
            export_dir=self.dir / EXPORT,
        )

    def _finish(self, ending: Ending) -> int:
        """Say how the attempt ended (:func:`~minifield.attempt.endings.record`)."""
        writer = self.options.group.is_writer
        if writer:
            try:  # held since the start for these last words
                attempt_setup.release_reserve(self.dir)
            except OSError as exc:  # a failing disk: result.json is still tried
                self.say(f"the reserve was not given back: {exc}")
        try:
            ending = endings.record(
                ending,
                self.events,
                self.progress,
                result_file=self.dir / RESULT if writer else None,
                document=lambda final: _result_document(self, final),
                say=self.say,
            )
        finally:
            self.stopping.preemption.restore()
        if ending.status == "io_failed":
            self.say(
                "the output could not be written; once there is room, resume from the last "
                f"committed checkpoint: --resume-from {self.dir}"
            )
        self.ending = ending
        return ending.code


def _setup_context(attempt: Attempt) -> attempt_setup.SetUpContext:
    """What set-up reads of an opened attempt, named."""
    options = attempt.options
    return attempt_setup.SetUpContext(
        recipe=attempt.recipe,
        attempt_id=attempt.attempt_id,
        directory=attempt.dir,
        env=attempt.env,
        started=attempt.started,
        group=options.group,
        input_root=options.input_root,
        examples_dir=options.examples_dir,
        quantized_base_dir=options.quantized_base_dir,
        resume_from=options.resume_from,
        allow_environment_change=options.allow_environment_change,
        compilation_cache=options.compilation_cache,
        events=attempt.events,
        progress=attempt.progress,
        say=attempt.say,
    )


def _result_document(attempt: Attempt, ending: Ending) -> dict:
    """``result.json`` of the attempt ended ``ending``: what it reads of the attempt, named."""
    return attempt_result.document(
        ending,
        attempt.progress,
        attempt.checkpoints.newest,
        recipe=attempt.recipe,
        attempt_id=attempt.attempt_id,
        env=attempt.env,
        resumed_from=attempt.options.resume_from,
        started=attempt.started,
    )


def _failure(error: AttemptError, exc: BaseException) -> Ending:
    """``io_failed`` when the output could not be written (a full disk: resumable once there
    is room), else ``failed``."""
    return Ending.io_failed(error) if atomic.is_io_failure(exc) else Ending.failed(error)


class Ended(NamedTuple):
    code: int
    attempt_dir: Path
    #: ``{"phase", "message"}`` of the ending (also in result.json, when it could be written)
    error: dict | None


def run(recipe: Recipe, options: Options) -> Ended:
    """Run one attempt; returns its exit code, directory and error."""
    if options.compilation_cache is not None:
        enable_compilation_cache(options.compilation_cache)
    attempt = Attempt(recipe, options)
    attempt.open()
    code = attempt.run()
    error = attempt.ending.error
    return Ended(code, attempt.dir, error.as_dict() if error else None)
