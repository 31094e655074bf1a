"""What one attempt is asked to do beyond its recipe: where its inputs and outputs are, where it
resumes from, operational limits and faults (none of them in the computation digest)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from ..supervision import distributed
from .faults import Faults


@dataclass
class Options:
    input_root: Path
    output_root: Path
    resume_from: Path | None = None
    attempt_id: str | None = None
    examples_dir: Path | None = None
    #: the recipe's quantized base product (None: quantized in memory, the same bits)
    quantized_base_dir: Path | None = None
    allow_environment_change: bool = False
    #: the per-update state-hash cadence: True/1 every update, K every K updates,
    #: False/"checkpoint" none (checkpoint manifests always carry the hash)
    record_state_hashes: bool | int | str = False
    #: JAX persistent compilation cache directory (None: no persistent cache)
    compilation_cache: Path | None = None
    #: operational step limit (qualification runs): end after this many updates with a
    #: committed checkpoint and ``limit_reached``; not part of the recipe or its digest
    stop_after_step: int | None = None
    faults: Faults = field(default_factory=Faults)
    #: the processes of this attempt (one, unless started with ``--distributed``)
    group: distributed.Group = field(default_factory=distributed.Group)


def computation_cache(work_dir: Path) -> Path:
    """The compilation cache the pipeline gives a computation's workers (training and its
    recovery proof): the directory the environment names for JAX's own cache
    (``JAX_COMPILATION_CACHE_DIR``), so every computation of a user's (or a test session's)
    runs shares one, else the computation's ``work_dir/jax-cache``. Either way a retried or
    resumed attempt finds the executables of the attempts before it; a loaded executable
    computes what a compiled one does (docs/development.md)."""
    named = os.environ.get("JAX_COMPILATION_CACHE_DIR", "").strip()
    return Path(named) if named else Path(work_dir) / "jax-cache"


def enable_compilation_cache(directory: Path) -> None:
    """Persist every compiled executable under ``directory`` (even fast compiles), so a
    resumed attempt loads its step function instead of compiling it again."""
    import jax

    directory.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(directory))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
