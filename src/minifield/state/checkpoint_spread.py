"""Committing a state spread over several processes (format 4, :mod:`.checkpoint_parts`),
two ways:

- :func:`save` — a collective: every process writes its part, the processes exchange only
  whether their part is durable, process 0 commits; every process returns once committed
  (the end of training, a preemption, a limit);
- :func:`save_in_background` — what one process's checkpoint thread runs while training
  goes on: no collective at all (JAX's multi-process collectives are not ordered across
  threads). Every process writes its part and its description into a temporary directory
  named for this write alone; process 0 waits on the file system for the others' descriptions (or
  a failure marker), then commits. The update loop learns the outcome at its next commit
  point (``CheckpointCadence.wait``, a collective on the main thread).

Both commit with one rename of a directory whose manifest was fsynced last: a process
killed at any point before it leaves only a temporary directory, never adopted.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from ..digest import sha256_bytes
from . import checkpoint, checkpoint_parts
from .arrays import STATE_HASH_VERSION, hash_named_arrays, named_leaves
from .checkpoint import CheckpointError, CheckpointRecord, step_dir_name

#: how long process 0's checkpoint thread waits for the other parts
PARTS_TIMEOUT_SECONDS = 1800.0


def _commit(
    tmp: Path,
    final: Path,
    leaves,
    descriptions: list[dict],
    digests: dict[str, str],
    head: dict,
) -> str:
    """Write the manifest of the parts described, then commit ``tmp`` as ``final``; returns
    the manifest's sha256."""
    data = checkpoint.encode_manifest(
        checkpoint_parts.manifest(leaves, descriptions, digests, head)
    )
    for rank in range(len(descriptions)):  # the manifest holds what they said
        (tmp / checkpoint_parts.part_description(rank)).unlink()
    checkpoint.commit_directory(tmp, final, data)
    return sha256_bytes(data)


def _head(step: int, computation_digest: str, state_hash: str, extra: dict | None) -> dict:
    return {
        "step": step,
        "computation_digest": computation_digest,
        "state_hash": state_hash,
        "state_hash_version": STATE_HASH_VERSION,
        "extra": extra or {},
    }


def save(
    directory: Path,
    state: Any,
    *,
    step: int,
    computation_digest: str,
    group,
    digests: dict[str, str],
    extra: dict | None = None,
    keep: int | None = None,
    fault=None,
) -> CheckpointRecord:
    """Commit ``state``, spread over the processes of ``group``, as checkpoint ``step`` (a
    collective): each process writes the blocks its devices hold, process 0 commits once
    every part is durable. ``digests`` are the state's version-3 per-array digests
    (``arrays.state_digests``: hashed where the arrays live). Nothing is gathered. Returns
    the record on every process (path and manifest sha256 on process 0 only); raises
    :class:`CheckpointError` on every process if any part or the commit failed, the previous
    checkpoints untouched."""
    leaves = named_leaves(state)
    final = directory / step_dir_name(step)
    tmp = directory / f".tmp-{step_dir_name(step)}-parts"
    state_hash = hash_named_arrays(leaves, digests=digests)
    committed: dict[str, str] = {}

    def open_directory() -> None:
        checkpoint.check_step(directory, step)
        if tmp.exists():  # a killed attempt's, never committed
            shutil.rmtree(tmp)
        tmp.mkdir()

    def commit(descriptions: list[dict]) -> None:
        head = _head(step, computation_digest, state_hash, extra)
        committed["sha256"] = _commit(tmp, final, leaves, descriptions, digests, head)

    checkpoint_parts.save(
        tmp, leaves, group, open_directory=open_directory, commit=commit, fault=fault
    )
    if group.rank != 0:
        return CheckpointRecord(step, None, None, state_hash)
    if keep is not None:
        checkpoint.prune(directory, keep)
    return CheckpointRecord(step, str(final), committed["sha256"], state_hash)


class BackgroundPart:
    """One process's share of a checkpoint written in the background: taken on the main
    thread at the step boundary (:meth:`take`: the blocks this process writes, as host
    views, and the shapes for the manifest), written by :meth:`__call__` on the checkpoint
    thread."""

    def __init__(self, directory: Path, step: int, *, rank: int, count: int, tag: str):
        self.directory, self.step, self.rank, self.count = directory, step, rank, count
        # ``tag``: the same on every process, new for every write (never a leftover's name)
        self.tmp = directory / f".tmp-{step_dir_name(step)}-{tag}"
        self.blocks: list = []
        self.leaves: list = []

    def take(self, state: Any) -> BackgroundPart:
        import jax

        leaves = named_leaves(state)
        self.blocks = checkpoint_parts.blocks_of(leaves, self.rank)
        # shapes and dtypes only: the arrays may be donated to the next update
        self.leaves = [(name, jax.ShapeDtypeStruct(a.shape, a.dtype)) for name, a in leaves]
        return self

    def __call__(
        self,
        *,
        computation_digest: str,
        digests: dict[str, str],
        extra: dict | None = None,
        keep: int | None = None,
        fault=None,
    ) -> CheckpointRecord:
        """Write this process's part; on process 0, wait for the others' and commit."""
        state_hash = hash_named_arrays(self.leaves, digests=digests)
        try:
            self.tmp.mkdir(parents=True, exist_ok=True)
            description = checkpoint_parts.write_part(self.tmp, self.rank, self.count, self.blocks)
            if fault is not None:
                fault("part_written")
            checkpoint_parts.announce(self.tmp, description)
        except (OSError, CheckpointError) as exc:
            checkpoint_parts.mark_failed(self.tmp, self.rank, f"{type(exc).__name__}: {exc}")
            raise
        finally:
            self.blocks = []  # the views would hold the device buffers
        if self.rank != 0:
            return CheckpointRecord(self.step, None, None, state_hash)
        final = self.directory / step_dir_name(self.step)
        try:
            others = checkpoint_parts.await_parts(self.tmp, self.count, PARTS_TIMEOUT_SECONDS)
            if fault is not None:
                fault("before_commit")
            checkpoint.check_step(self.directory, self.step)
            head = _head(self.step, computation_digest, state_hash, extra)
            sha = _commit(self.tmp, final, self.leaves, [description, *others], digests, head)
        except BaseException:
            shutil.rmtree(self.tmp, ignore_errors=True)
            raise
        if keep is not None:
            checkpoint.prune(self.directory, keep)
        return CheckpointRecord(self.step, str(final), sha, state_hash)
