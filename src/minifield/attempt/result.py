"""How an attempt ends: its status, exit code and error, and the ``result.json`` that says so.

Every attempt that got its directory ends in exactly one :class:`Ending` and one
``result.json``, whatever happened: completed (exit 0), failed (1, or 2 when the job,
its inputs or the resume were refused), preempted (3: a checkpoint is committed), a
limit reached (4: likewise) or an I/O failure (5: the output could not be written — a full
disk, a quota, a file-size limit, a read-only or failing device; the committed checkpoints
stay valid, so the attempt is resumed once there is room) or the accelerator busy (6:
another process held it for all the time there was to wait; nothing was trained).
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from . import environment

if TYPE_CHECKING:  # an annotation only: importing the checkpoint code would start JAX in
    # every process that reads an attempt's result (the pipeline's supervising stages)
    from ..state.checkpoint import CheckpointRecord

EXIT_COMPLETED, EXIT_FAILED, EXIT_INVALID, EXIT_PREEMPTED, EXIT_LIMIT = 0, 1, 2, 3, 4
#: the output could not be written (:func:`minifield.atomic.is_io_failure`); resumable
EXIT_IO = 5
#: the accelerator stayed held by another process (:mod:`~minifield.attempt.device_claim`)
EXIT_DEVICE_BUSY = 6


def now_iso() -> str:
    return dt.datetime.now(dt.UTC).isoformat(timespec="milliseconds")


@dataclass(frozen=True)
class AttemptError:
    """What went wrong, and in which phase (``start``, ``device``, ``inputs``, ``examples``,
    ``compile``, ``restore``, ``resume``, ``train``, ``diverged``, ``limits``)."""

    phase: str
    message: str

    def as_dict(self) -> dict[str, str]:
        return {"phase": self.phase, "message": self.message}


@dataclass(frozen=True)
class Ending:
    #: "completed" | "failed" | "preempted" | "limit_reached" | "io_failed" | "device_busy"
    status: str
    code: int
    error: AttemptError | None = None

    @classmethod
    def completed(cls) -> Ending:
        return cls("completed", EXIT_COMPLETED)

    @classmethod
    def failed(cls, error: AttemptError, code: int = EXIT_FAILED) -> Ending:
        return cls("failed", code, error)

    @classmethod
    def preempted(cls) -> Ending:
        return cls("preempted", EXIT_PREEMPTED)

    @classmethod
    def limit_reached(cls, reason: str) -> Ending:
        return cls("limit_reached", EXIT_LIMIT, AttemptError("limits", reason))

    @classmethod
    def io_failed(cls, error: AttemptError) -> Ending:
        return cls("io_failed", EXIT_IO, error)

    @classmethod
    def device_busy(cls, message: str) -> Ending:
        return cls("device_busy", EXIT_DEVICE_BUSY, AttemptError("device", message))


@dataclass
class Progress:
    """What the attempt has to show so far; ``result.json`` reports it whatever the ending."""

    #: the verified inputs, as ``{name, path, sha256}``
    inputs: list[dict] = field(default_factory=list)
    steps_completed: int = 0
    metrics: dict[str, Any] = field(default_factory=dict)
    final_state_hash: str | None = None
    #: the definition ``final_state_hash`` follows (``state.arrays.STATE_HASH_VERSION``)
    state_hash_version: int | None = None
    #: environment fields that changed since the resumed attempt, when that was allowed
    environment_override: dict | None = None


def document(
    ending: Ending,
    progress: Progress,
    checkpoint: CheckpointRecord | None,
    *,
    recipe,
    attempt_id: str,
    env: dict,
    resumed_from: Path | None,
    started: str,
) -> dict:
    """The content of ``result.json``."""
    import jax

    return {
        "status": ending.status,
        "job_id": recipe.data["job_id"],
        "attempt_id": attempt_id,
        "computation_digest": recipe.computation_digest,
        "examples_digest": recipe.examples_digest,
        "strategy": {"name": recipe.strategy.name, "version": recipe.strategy.version},
        "inputs": progress.inputs,
        "checkpoint": checkpoint.as_dict() if checkpoint else None,
        "steps_completed": progress.steps_completed,
        "final_state_hash": progress.final_state_hash,
        "state_hash_version": progress.state_hash_version,
        "metrics": progress.metrics,
        "environment": {
            # every bit-defining field (versions, backend, devices, XLA flags, threads,
            # PRNG implementation, precision), as compared before a resume
            **{k: env[k] for k in environment.BIT_DEFINING},
            "jax_version": jax.__version__,
            "package_version": env["package_version"],
            "code_hash": env["code_hash"],
            "source_revision": env["source_revision"],
        },
        "environment_override": progress.environment_override,
        "resumed_from": str(resumed_from) if resumed_from else None,
        "error": ending.error.as_dict() if ending.error else None,
        "started": started,
        "ended": now_iso(),
    }
