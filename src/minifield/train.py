"""One training attempt: verify inputs, restore or init, update, checkpoint, evaluate, export.

An attempt writes only into its own fresh directory ``OUT/<job_id>/<attempt_id>/``.
Resuming reads a previous attempt directory (and, through ``attempt.json``, the
chain of attempts before it) and never writes into it.

A multi-process attempt (:mod:`minifield.distributed`) runs this same program in
every process, each on its part of the device mesh. Only process 0 writes: the
attempt directory, ``attempt.json``, events, checkpoints (the state is brought to
the host collectively, then committed once), the export and ``result.json``. What
is not a pure function of the recipe is decided together (:class:`~minifield.
distributed.Group`): the attempt id, the outcome of set-up, and whether a signal or
a time limit stops the run before the next update.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import secrets
import shutil
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import atomic, attempts, checkpoint, distributed, environment, examples, inputs
from .events import EventLog
from .events import read as read_events
from .recipe import Recipe

EXIT_COMPLETED, EXIT_FAILED, EXIT_INVALID, EXIT_PREEMPTED, EXIT_LIMIT = 0, 1, 2, 3, 4
ATTEMPT_FILE = attempts.ATTEMPT_FILE
RESULT_FILE = "result.json"


class ResumeRefused(Exception):
    """The previous attempt cannot be resumed by this recipe/environment (exit 2)."""


@dataclass
class Faults:
    """Fault injection for tests and qualification: never part of the recipe or its digest."""

    fail_after_step: int | None = None
    stall_after_step: int | None = None
    stall_seconds: float = 10.0
    #: SIGKILL itself in the middle of writing checkpoint K (arrays written, not committed)
    kill_during_checkpoint: int | None = None


@dataclass
class Options:
    input_root: Path
    output_root: Path
    resume_from: Path | None = None
    attempt_id: str | None = None
    examples_dir: Path | None = None
    allow_environment_change: bool = False
    record_state_hashes: bool = False
    #: JAX persistent compilation cache directory (None: no persistent cache)
    compilation_cache: Path | None = None
    #: operational step limit (qualification runs): end after this many updates with a
    #: committed checkpoint and ``limit_reached``; not part of the recipe or its digest
    stop_after_step: int | None = None
    faults: Faults = field(default_factory=Faults)
    #: the processes of this attempt (one, unless started with ``--distributed``)
    group: distributed.Group = field(default_factory=distributed.Group)


def new_attempt_id() -> str:
    return dt.datetime.now(dt.UTC).strftime("a%Y%m%dT%H%M%SZ-") + secrets.token_hex(3)


def enable_compilation_cache(directory: Path) -> None:
    """Persist every compiled executable under ``directory`` (even fast compiles), so a
    resumed attempt loads its step function instead of compiling it again."""
    import jax

    directory.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(directory))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def _now_iso() -> str:
    return dt.datetime.now(dt.UTC).isoformat(timespec="milliseconds")


class _Preemption:
    """SIGTERM/SIGINT set a flag; the loop finishes the update, checkpoints and exits 3.

    Further signals while saving only set the flag again, so a second signal can
    never interrupt a checkpoint write half-way.
    """

    def __init__(self) -> None:
        self.signal: int | None = None
        self._previous: dict[int, Any] = {}

    def install(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum, frame) -> None:  # noqa: ARG002
        if self.signal is None:
            self.signal = signum

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def _kill_self() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _attempt_chain(start: Path) -> list[Path]:
    """``start`` and the attempts it resumed from, newest first."""
    return list(reversed(attempts.chain(start)))


def _attempt_compute_seconds(attempt_dir: Path) -> float:
    """Training seconds spent by this attempt and every attempt before it (from raw events)."""
    info_path = attempt_dir / ATTEMPT_FILE
    before = (
        atomic.read_json(info_path).get("compute_seconds_before", 0.0)
        if info_path.is_file()
        else 0.0
    )
    own = 0.0
    events_path = attempt_dir / "events.jsonl"
    if events_path.is_file():
        events, _ = read_events(events_path)
        own = sum(e.get("seconds", 0.0) for e in events if e["type"] == "update")
    return before + own


class Attempt:
    def __init__(self, recipe: Recipe, options: Options):
        self.recipe = recipe
        self.options = options
        self.data = recipe.data
        self.env = environment.fingerprint()
        self.started_iso = _now_iso()
        self.started_mono = time.monotonic()
        self.result: dict[str, Any] = {}
        #: the newest committed checkpoint {step, path, sha256} (path and sha256 are None on
        #: processes other than 0, which take part in the commit but do not write it)
        self.checkpoint_record: dict | None = None
        self.steps_completed = 0
        self.metrics: dict[str, Any] = {}
        self.preemption = _Preemption()

    # -- set-up -------------------------------------------------------------------------
    def _choose_attempt_id(self, job_dir: Path) -> str:
        if self.options.attempt_id:
            return self.options.attempt_id
        wanted = self.data.get("attempt_id")
        if wanted and not (job_dir / wanted).exists():
            return wanted
        if wanted and self.options.resume_from is None:
            raise ResumeRefused(
                f"attempt directory {job_dir / wanted} already exists: every execution needs a fresh "
                "attempt_id (omit attempt_id from the recipe, or pass --attempt-id)"
            )
        return new_attempt_id()

    def open(self) -> None:
        """Process 0 creates the attempt directory; every process learns its id from it."""
        group = self.options.group
        job_dir = self.options.output_root / self.data["job_id"]
        failure, message = None, ""
        if group.is_writer:
            try:
                job_dir.mkdir(parents=True, exist_ok=True)
                attempt_id = self._choose_attempt_id(job_dir)
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
        self.attempt_id = text
        self.dir = job_dir / self.attempt_id
        self.checkpoint_dir = self.dir / "checkpoints"
        self.events = (
            EventLog(self.dir / "events.jsonl") if group.is_writer else EventLog(None, None)
        )

    # -- resume -------------------------------------------------------------------------
    def _check_previous(self, previous: Path) -> dict:
        info_path = previous / ATTEMPT_FILE
        if not info_path.is_file():
            raise ResumeRefused(f"{previous} is not an attempt directory (no {ATTEMPT_FILE})")
        info = atomic.read_json(info_path)
        if info.get("computation_digest") != self.recipe.computation_digest:
            raise ResumeRefused(
                f"refusing to resume {previous}: it ran computation {info.get('computation_digest')}, "
                f"but this recipe is computation {self.recipe.computation_digest} "
                "(a changed recipe is a new computation; start it fresh)"
            )
        diff = environment.differences(info.get("environment", {}), self.env)
        if diff and not self.options.allow_environment_change:
            fields = ", ".join(
                f"{k}: {v['recorded']!r} -> {v['current']!r}" for k, v in diff.items()
            )
            raise ResumeRefused(
                f"refusing to resume {previous}: the environment changed ({fields}); this can change "
                "the bits of the result. Restore the environment, or pass --allow-environment-change "
                "to accept it (the override is recorded)"
            )
        self.environment_override = diff or None
        return info

    def _restore(self, program) -> dict | None:
        """Newest valid checkpoint along the attempt chain, or None (fresh start)."""
        for attempt_dir in _attempt_chain(self.options.resume_from):
            ckpt_dir = attempt_dir / "checkpoints"
            for step in reversed(checkpoint.committed_steps(ckpt_dir)):
                path = ckpt_dir / checkpoint.step_dir_name(step)
                try:
                    state, manifest = checkpoint.load(
                        path,
                        program.init_state(),
                        computation_digest=self.recipe.computation_digest,
                    )
                except checkpoint.CheckpointError as exc:
                    self.events.emit(
                        "checkpoint_rejected", step=step, path=str(path), reason=str(exc)
                    )
                    print(f"minifield-worker: rejected checkpoint {path}: {exc}", file=sys.stderr)
                    continue
                sha = checkpoint.manifest_sha256(path)
                self.events.emit(
                    "restored",
                    step=step,
                    path=str(path),
                    sha256=sha,
                    state_hash=manifest["state_hash"],
                )
                self.checkpoint_record = {"step": step, "path": str(path), "sha256": sha}
                return state
        self.events.emit(
            "restore_fallback",
            reason="no valid committed checkpoint in the attempt chain; starting from step 0",
        )
        return None

    # -- limits -------------------------------------------------------------------------
    def _limit_reason(self, compute_used: float, step: int = 0) -> str | None:
        stop_after = self.options.stop_after_step
        if stop_after is not None and step >= stop_after:
            return f"stop_after_step={stop_after} reached (operational step limit)"
        limits = self.data["limits"]
        if limits.get("deadline"):
            deadline = dt.datetime.fromisoformat(limits["deadline"].replace("Z", "+00:00"))
            if deadline.tzinfo is None:
                deadline = deadline.replace(tzinfo=dt.UTC)
            if dt.datetime.now(dt.UTC) >= deadline:
                return f"deadline {limits['deadline']} reached"
        if (
            limits.get("max_wall_seconds")
            and time.monotonic() - self.started_mono >= limits["max_wall_seconds"]
        ):
            return f"max_wall_seconds={limits['max_wall_seconds']} reached in this attempt"
        if limits.get("max_compute_seconds") and compute_used >= limits["max_compute_seconds"]:
            return f"cumulative compute budget max_compute_seconds={limits['max_compute_seconds']} used ({compute_used:.3f} s)"
        return None

    def _kill_during_checkpoint(self, step: int) -> None:
        """Fault injection: arrays written, manifest not yet — a crash mid-checkpoint."""
        self.events.emit("fault_kill", durable=True, phase="checkpoint_write", step=step)
        _kill_self()

    def _commit(self, state, step: int, compute_used: float) -> None:
        """Every process brings the state to the host (a collective when it is sharded over
        processes); process 0 alone writes and commits it; all leave once it is committed."""
        from .state import named_arrays

        group = self.options.group
        started = time.monotonic()
        arrays = named_arrays(state)
        if not group.is_writer:
            self.checkpoint_record = {"step": step, "path": None, "sha256": None}
            group.barrier(f"checkpoint-{step}")
            return
        committed = checkpoint.save(
            self.checkpoint_dir,
            arrays,
            step=step,
            computation_digest=self.recipe.computation_digest,
            extra={"attempt_id": self.attempt_id, "compute_seconds": compute_used},
            keep=self.data["checkpoint"]["keep"],
            before_commit=(lambda: self._kill_during_checkpoint(step))
            if self.options.faults.kill_during_checkpoint == step
            else None,
        )
        group.barrier(f"checkpoint-{step}")
        self.checkpoint_record = {
            "step": step,
            "path": str(committed.path),
            "sha256": committed.sha256,
        }
        self.events.emit(
            "checkpoint_committed",
            durable=True,
            step=step,
            path=str(committed.path),
            sha256=committed.sha256,
            state_hash=committed.state_hash,
            seconds=time.monotonic() - started,
        )

    # -- the run ------------------------------------------------------------------------
    def run(self) -> int:
        self.preemption.install()
        self.environment_override = None
        outcome = self._agree_on_set_up(self._set_up())
        if outcome["kind"] == "failed":
            return self._finish("failed", outcome["code"], error=outcome["error"])
        if outcome["kind"] == "adopt":
            return self._adopt_completed(outcome["previous"])
        try:
            program = outcome["program"]
            # restored arrays come from host files: put them where the compiled update wants
            # them (over several processes a collective, hence only once all agreed to start)
            state = program.place(outcome["state"])
            return self._train(program, state, outcome["step"], outcome["compute_before"])
        except Exception as exc:  # noqa: BLE001 - every failure must end in a result.json
            return self._finish(
                "failed",
                EXIT_FAILED,
                error={"phase": "train", "message": f"{type(exc).__name__}: {exc}"},
            )

    def _set_up(self) -> dict:
        """Everything before the first update; returns what to do next (never raises)."""
        phase = "start"
        try:
            previous_info = (
                self._check_previous(self.options.resume_from) if self.options.resume_from else None
            )
            compute_before = (
                _attempt_compute_seconds(self.options.resume_from)
                if self.options.resume_from
                else 0.0
            )
            if self.options.group.is_writer:
                atomic.write_json(
                    self.dir / ATTEMPT_FILE,
                    {
                        "job_id": self.data["job_id"],
                        "attempt_id": self.attempt_id,
                        "computation_digest": self.recipe.computation_digest,
                        "examples_digest": self.recipe.examples_digest,
                        "resumed_from": str(self.options.resume_from.resolve())
                        if self.options.resume_from
                        else None,
                        "compute_seconds_before": compute_before,
                        "environment": self.env,
                        "environment_override": self.environment_override,
                        "processes": {
                            "count": self.options.group.size,
                            "source": self.options.group.topology.source,
                            "coordinator": self.options.group.topology.coordinator,
                        },
                        "started": self.started_iso,
                    },
                )
            self.events.emit(
                "attempt_started",
                job_id=self.data["job_id"],
                attempt_id=self.attempt_id,
                computation_digest=self.recipe.computation_digest,
                resumed_from=str(self.options.resume_from) if self.options.resume_from else None,
                environment_override=self.environment_override,
            )
            phase = "device"
            self._check_device()
            if previous_info is not None:
                completed = self._previous_completed(self.options.resume_from)
                if completed is not None:
                    return {"kind": "adopt", "previous": completed}

            phase = "inputs"
            verified = inputs.verify(self.data, self.options.input_root)
            self.result["inputs"] = [
                {"name": v["name"], "path": v["path"], "sha256": v["sha256"]} for v in verified
            ]
            self.events.emit("inputs_verified", inputs=self.result["inputs"])

            phase = "examples"
            strategy = self.recipe.strategy
            if self.options.examples_dir is not None:
                example_arrays, _ = examples.load(
                    self.options.examples_dir, self.recipe.examples_digest
                )
            else:
                example_arrays, _ = strategy.prepare(
                    self.data, inputs.files_by_name(self.data, self.options.input_root)
                )

            phase = "compile"
            program = strategy.build(self.data, example_arrays)
            started = time.monotonic()
            program.compile()
            self.events.emit(
                "compiled",
                seconds=time.monotonic() - started,
                compilation_cache=str(self.options.compilation_cache)
                if self.options.compilation_cache
                else None,
                placement=program.placement,
            )

            phase = "restore"
            state = self._restore(program) if self.options.resume_from else None
            if state is None:
                state = program.init_state()
            step = int(state["step"])
            self.steps_completed = step
            return {
                "kind": "train",
                "program": program,
                "state": state,
                "step": step,
                "compute_before": compute_before,
            }
        except ResumeRefused as exc:
            error, code = {"phase": "resume", "message": str(exc)}, EXIT_INVALID
        except (inputs.InputError, examples.ExamplesError) as exc:
            error, code = {"phase": phase, "message": str(exc)}, EXIT_INVALID
        except Exception as exc:  # noqa: BLE001 - every failure must end in a result.json
            error = {"phase": phase, "message": f"{type(exc).__name__}: {exc}"}
            code = EXIT_FAILED
        return {"kind": "failed", "code": code, "error": error}

    def _agree_on_set_up(self, outcome: dict) -> dict:
        """All processes start training from the same checkpoint, or none does.

        A process that failed set-up (inputs it cannot read, a checkpoint it cannot see)
        fails every process, with its own error named, instead of leaving the others
        waiting in the first collective of the update.
        """
        group = self.options.group
        if group.size == 1:
            return outcome
        record = self.checkpoint_record or {}
        mine = {
            "kind": outcome["kind"],
            "code": outcome.get("code"),
            "phase": outcome.get("error", {}).get("phase"),
            "message": outcome.get("error", {}).get("message", "")[:600],
            "step": outcome.get("step"),
            "checkpoint": record.get("sha256"),
        }
        reports = [json.loads(text) for text in group.gather_texts(json.dumps(mine))]
        if outcome["kind"] == "failed":
            return outcome
        for rank, report in enumerate(reports):
            if report["kind"] == "failed":
                return {
                    "kind": "failed",
                    "code": report["code"],
                    "error": {
                        "phase": report["phase"],
                        "message": f"process {rank} failed: {report['message']}",
                    },
                }
        starts = {(r["kind"], r["step"], r["checkpoint"]) for r in reports}
        if len(starts) > 1:
            seen = "; ".join(
                f"process {rank}: {r['kind']} at step {r['step']} from checkpoint {r['checkpoint']}"
                for rank, r in enumerate(reports)
            )
            return {
                "kind": "failed",
                "code": EXIT_FAILED,
                "error": {
                    "phase": "restore",
                    "message": f"the processes would start from different states ({seen}); "
                    "every process must see the same output root (a shared filesystem)",
                },
            }
        return outcome

    def _check_device(self) -> None:
        import jax

        runtime = self.data.get("runtime", {})
        backend = runtime.get("backend", "any")
        devices = jax.devices()
        data_parallel = self.recipe.strategy.devices_required(self.data)
        self.events.emit(
            "device",
            backend=jax.default_backend(),
            device_kind=self.env["device_kind"],
            device_count=len(devices),
            process_count=jax.process_count(),
            data_parallel_devices=data_parallel,
        )
        if backend != "any" and jax.default_backend() != backend:
            raise RuntimeError(
                f"recipe runtime.backend={backend!r} but JAX runs on {jax.default_backend()!r} here "
                f"(devices: {[str(d) for d in devices]}); run on a {backend} host or set runtime.backend"
            )
        if len(devices) < runtime.get("min_devices", 1):
            raise RuntimeError(
                f"recipe runtime.min_devices={runtime['min_devices']} but only {len(devices)} device(s) visible"
            )
        if len(devices) < data_parallel:
            from .strategies.packed_sft.parallel import missing_devices_message

            raise RuntimeError(missing_devices_message(data_parallel, len(devices)))
        processes = self.options.group.size
        if processes > 1 and data_parallel != len(devices):
            raise RuntimeError(
                f"{processes} processes hold {len(devices)} devices in all, but the recipe's "
                f"training.data_parallel.devices is {data_parallel} (strategy "
                f"{self.recipe.strategy.name}): a multi-process attempt spreads every batch over "
                f"the devices of all its processes. Set training.data_parallel.devices: "
                f"{len(devices)} (a strategy with data parallelism), or start one process"
            )

    def _previous_completed(self, previous: Path) -> dict | None:
        for attempt_dir in _attempt_chain(previous):
            result_path = attempt_dir / RESULT_FILE
            if result_path.is_file():
                result = atomic.read_json(result_path)
                if result.get("status") == "completed":
                    return {**result, "_dir": str(attempt_dir)}
                return None
        return None

    def _adopt_completed(self, previous: dict) -> int:
        """Resuming a completed attempt trains nothing and reports the same final state."""
        source_export = Path(previous["_dir"]) / "export"
        if source_export.is_dir() and self.options.group.is_writer:
            shutil.copytree(source_export, self.dir / "export")
        self.steps_completed = previous["steps_completed"]
        self.checkpoint_record = previous.get("checkpoint")
        self.metrics = previous.get("metrics", {})
        self.result["inputs"] = previous.get("inputs", [])
        self.result["final_state_hash"] = previous.get("final_state_hash")
        self.events.emit(
            "already_completed",
            attempt=previous["_dir"],
            final_state_hash=previous.get("final_state_hash"),
        )
        return self._finish("completed", EXIT_COMPLETED)

    def _stop_before_update(self, compute_used: float, step: int) -> tuple[str, str] | None:
        """``("preempt", signal)`` or ``("limit", reason)`` when this process or any other must
        stop before the next update, else None. Signals and time limits reach processes at
        different moments; deciding together keeps every process at the same step."""
        code, text = 0, ""
        if self.preemption.signal is not None:
            code, text = 2, signal.Signals(self.preemption.signal).name
        else:
            reason = self._limit_reason(compute_used, step)
            if reason:
                code, text = 1, reason
        group = self.options.group
        codes = group.gather_ints(code)
        decided = max(codes)
        if decided == 0:
            return None
        texts = group.gather_texts(text)
        if code != decided:
            rank = codes.index(decided)
            text = f"{texts[rank]} (on process {rank})"
        return ("preempt" if decided == 2 else "limit", text)

    def _log(self, message: str) -> None:
        rank = self.options.group.rank
        print(f"minifield-worker{f'[{rank}]' if rank else ''}: {message}", file=sys.stderr)

    def _train(self, program, state, step: int, compute_before: float) -> int:
        import jax

        from .state import hashes, state_hash, to_host

        max_steps = self.data["limits"]["max_steps"]
        every = self.data["checkpoint"]["every_steps"]
        faults = self.options.faults
        compute_used = compute_before
        eval_every = getattr(program, "eval_every", 0)
        while step < max_steps:
            stop = self._stop_before_update(compute_used, step)
            if stop is not None and stop[0] == "preempt":
                return self._preempt(state, step, compute_used, stop[1])
            if stop is not None:
                return self._limit(state, step, compute_used, stop[1])
            started = time.monotonic()
            state, metrics = program.step(state)
            seconds = time.monotonic() - started
            step += 1
            compute_used += seconds
            self.steps_completed = step
            update = {
                "step": step,
                "examples": program.examples_per_step,
                "tokens": program.tokens_per_step,
                "seconds": seconds,
                **metrics,
            }
            if self.options.record_state_hashes:
                # Both from one host copy: the whole-state hash, and one per part so that a
                # divergence can be named (params, opt_state, rng, step, cursor).
                update["state_hash"], update["part_hashes"] = hashes(state)
            self.events.emit("update", **update)
            self.metrics["final_loss"] = metrics.get("loss")
            self._log(
                f"update {step}/{max_steps} loss={metrics.get('loss'):.6g} ({seconds * 1000:.1f} ms)"
            )
            if faults.fail_after_step is not None and step == faults.fail_after_step:
                # Hard exit without any cleanup, as a crash would: nothing after this update is saved.
                os._exit(EXIT_FAILED)
            if faults.stall_after_step is not None and step == faults.stall_after_step:
                time.sleep(faults.stall_seconds)
            if step % every == 0 or step == max_steps:
                self._commit(state, step, compute_used)
            if eval_every and step % eval_every == 0 and step < max_steps:
                started = time.monotonic()
                periodic = program.evaluate(state)
                self.events.emit(
                    "evaluation",
                    step=step,
                    metrics=periodic,
                    seconds=time.monotonic() - started,
                    final=False,
                )
        if self.checkpoint_record is None or self.checkpoint_record["step"] != step:
            self._commit(state, step, compute_used)
        if self.options.group.size > 1:
            # one host copy on every process (a collective when sharded over processes), so
            # that process 0 alone can export it afterwards
            state = jax.tree_util.tree_map(to_host, state)
        started = time.monotonic()
        final_metrics = program.evaluate(state)
        self.metrics.update(final_metrics)
        self.events.emit(
            "evaluation",
            step=step,
            metrics=final_metrics,
            seconds=time.monotonic() - started,
            final=True,
        )
        if self.options.group.is_writer:
            program.export(state, self.dir / "export")
        self.result["final_state_hash"] = state_hash(state)
        return self._finish("completed", EXIT_COMPLETED)

    def _preempt(self, state, step: int, compute_used: float, signal_name: str) -> int:
        if self.checkpoint_record is None or self.checkpoint_record["step"] != step:
            self._commit(state, step, compute_used)
        self.events.emit(
            "preempted",
            durable=True,
            signal=signal_name,
            step=step,
            checkpoint_sha256=self.checkpoint_record["sha256"],
            path=self.checkpoint_record["path"],
        )
        return self._finish("preempted", EXIT_PREEMPTED)

    def _limit(self, state, step: int, compute_used: float, reason: str) -> int:
        if self.checkpoint_record is None or self.checkpoint_record["step"] != step:
            self._commit(state, step, compute_used)
        self.events.emit("limit_reached", durable=True, step=step, reason=reason)
        return self._finish(
            "limit_reached", EXIT_LIMIT, error={"phase": "limits", "message": reason}
        )

    def _finish(self, status: str, code: int, error: dict | None = None) -> int:
        import jax

        result = {
            "status": status,
            "job_id": self.data["job_id"],
            "attempt_id": self.attempt_id,
            "computation_digest": self.recipe.computation_digest,
            "examples_digest": self.recipe.examples_digest,
            "strategy": {
                "name": self.recipe.strategy.name,
                "version": self.recipe.strategy.version,
            },
            "inputs": self.result.get("inputs", []),
            "checkpoint": self.checkpoint_record,
            "steps_completed": self.steps_completed,
            "final_state_hash": self.result.get("final_state_hash"),
            "metrics": self.metrics,
            "environment": {
                # every bit-defining field (versions, backend, devices, XLA flags, threads,
                # PRNG implementation, precision), as compared before a resume
                **{k: self.env[k] for k in environment.BIT_DEFINING},
                "jax_version": jax.__version__,
                "package_version": self.env["package_version"],
                "code_hash": self.env["code_hash"],
                "source_revision": self.env["source_revision"],
            },
            "environment_override": self.environment_override,
            "resumed_from": str(self.options.resume_from) if self.options.resume_from else None,
            "error": error,
            "started": self.started_iso,
            "ended": _now_iso(),
        }
        if status == "completed":
            self.events.emit(
                "completed",
                durable=True,
                steps=self.steps_completed,
                final_state_hash=result["final_state_hash"],
            )
        elif status == "failed":
            self.events.emit("failed", durable=True, **(error or {}))
        if self.options.group.is_writer:
            atomic.write_json(self.dir / RESULT_FILE, result)
        self.events.close()
        self.preemption.restore()
        return code


def run(recipe: Recipe, options: Options) -> tuple[int, Path]:
    """Run one attempt; returns (exit code, attempt directory)."""
    if options.compilation_cache is not None:
        enable_compilation_cache(options.compilation_cache)
    attempt = Attempt(recipe, options)
    attempt.open()
    return attempt.run(), attempt.dir
