"""``Store``: one store directory, its single-writer lock, and the operations on it."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from .. import atomic
from ..digest import sha256_file
from ..supervision import locks
from . import gate, hooks, pointer
from . import manifest as manifests
from .errors import LockTimeout, StoreError
from .layout import ARTIFACTS, LOCK, MANIFEST, POINTER, PROOF_EVIDENCE, is_sha256


class Store:
    def __init__(
        self,
        root: str | Path,
        lock_timeout: float | None = 60.0,
        mirror: hooks.Mirror | None = None,
    ):
        self.root = Path(root)
        self.lock_timeout = lock_timeout
        # told after each publication and move (the model registry); see .hooks
        self.mirror = mirror
        self.mirror_report: dict | None = None

    # -- locations ----------------------------------------------------------------------
    @property
    def artifacts(self) -> Path:
        return self.root / ARTIFACTS

    @property
    def pointer_path(self) -> Path:
        return self.root / POINTER

    def artifact_dir(self, content_id: str) -> Path:
        if not is_sha256(content_id):
            raise StoreError(f"{content_id!r} is not a content id (64 lower-case hex characters)")
        return self.artifacts / content_id

    # -- the single-writer lock -----------------------------------------------------------
    @contextlib.contextmanager
    def lock(self) -> Iterator[None]:
        """The store's write lock (DIR/.lock); waits up to ``lock_timeout`` s (None: forever).

        A :mod:`minifield.supervision.locks` lock: released by the kernel when the process ends,
        however it ends, so a crashed writer never leaves the store locked.
        """
        self.root.mkdir(parents=True, exist_ok=True)
        holder = {"pid": os.getpid(), "since": pointer.now_iso()}
        try:
            with locks.held(self.root / LOCK, holder, timeout_s=self.lock_timeout):
                yield
        except locks.LockTimeout as exc:
            raise LockTimeout(
                f"store {self.root} is locked by another writer ({exc.holder}); gave up "
                f"after {exc.waited_s:g} s (use --lock-timeout to wait longer)"
            ) from None

    # -- publish --------------------------------------------------------------------------
    def publish(self, export_dir: Path, **sources) -> tuple[str, bool]:
        """Copy the export into ``artifacts/<content-id>/``; returns (content id, newly created).

        ``sources`` are :func:`minifield.store.manifest.build`'s. Never touches
        ``active.json``. Writes into a staging directory and renames it into place, so
        an artifact directory is either complete or absent.
        """
        manifest = manifests.build(Path(export_dir), **sources)
        content_id = manifests.content_id(manifest)
        with self.lock():
            target = self.artifacts / content_id
            created = not target.is_dir()
            if created:
                self._write_artifact(export_dir, sources, manifest, target)
        # after the lock: a mirror (model registry) is told, never able to undo this
        self.mirror_report = hooks.notify(self.mirror, "published", self, content_id)
        return content_id, created

    def _write_artifact(self, export_dir: Path, sources: dict, manifest: dict, target: Path):
        """Stage every payload file and the manifest, then rename into place (under the lock)."""
        self.artifacts.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=".staging-", dir=self.artifacts))
        try:
            for item in manifest["payload"]:
                source = (
                    Path(sources["proof"])
                    if item["path"] == PROOF_EVIDENCE
                    else Path(export_dir) / item["path"]
                )
                _copy_verified(source, staging / item["path"], item["sha256"])
            atomic.write_json(staging / MANIFEST, manifest)
            os.replace(staging, target)
            atomic.fsync_dir(self.artifacts)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise

    # -- read -----------------------------------------------------------------------------
    def manifest(self, content_id: str) -> dict:
        path = self.artifact_dir(content_id) / MANIFEST
        if not path.is_file():
            raise StoreError(f"no artifact {content_id} in {self.artifacts} (missing {path})")
        return atomic.read_json(path)

    def read_pointer(self) -> dict:
        """The pointer, or an empty one when nothing was ever activated."""
        return pointer.read(self.pointer_path)

    def list(self) -> list[dict]:
        """Every published artifact, with its manifest summary and current/previous mark."""
        current = self.read_pointer()
        if not self.artifacts.is_dir():
            return []
        rows = []
        for entry in sorted(self.artifacts.iterdir()):
            if not is_sha256(entry.name):
                continue
            row: dict[str, Any] = {"content_id": entry.name, **_summary(entry / MANIFEST)}
            row["active"] = (
                "current"
                if entry.name == current.get("current")
                else "previous"
                if entry.name == current.get("previous")
                else None
            )
            rows.append(row)
        return rows

    # -- the gate and the moves of the pointer --------------------------------------------
    def check(self, content_id: str) -> dict:
        """Every activation check for ``content_id``; returns the report or raises Refused."""
        return gate.check(self.artifact_dir(content_id), content_id)

    def activate(self, content_id: str) -> dict:
        self.artifact_dir(content_id)  # rejects a malformed id before taking the lock
        return self._mirrored(self._move("activate", content_id))

    def rollback(self) -> dict:
        return self._mirrored(self._move("rollback", None))

    def _mirrored(self, report: dict) -> dict:
        """After a move passed the gate (never after a refusal): tell the mirror."""
        self.mirror_report = hooks.notify(self.mirror, "moved", self, report["pointer"])
        return report

    def _move(self, action: str, target: str | None) -> dict:
        """Check ``target`` (``None`` for rollback: the pointer's ``previous``) and move to it.

        Runs entirely under the lock, so the pointer read here is the one replaced.
        """
        with self.lock():
            before = self.read_pointer()
            if action == "rollback":
                target = pointer.rollback_target(before, self.pointer_path)
            report = self.check(target)
            if target == before.get("current"):
                return {**report, "action": action, "changed": False, "pointer": before}
            after = pointer.moved(before, action, target, report["acceptance"])
            pointer.write(self.pointer_path, after)
            return {**report, "action": action, "changed": True, "pointer": after}


def _copy_verified(source: Path, destination: Path, sha256: str) -> None:
    destination.parent.mkdir(parents=True, exist_ok=True)
    with atomic.naming(destination):
        shutil.copyfile(source, destination)
    # Re-hash the copy: a file changing under us must not publish a wrong id.
    if sha256_file(destination) != sha256:
        raise StoreError(f"{source}: changed while being published; try again")
    with atomic.naming(destination), open(destination, "rb") as handle:
        os.fsync(handle.fileno())


def _summary(manifest_path: Path) -> dict:
    """What ``list`` shows of one manifest (or why it cannot)."""
    try:
        manifest = atomic.read_json(manifest_path)
        declared = (manifest.get("validation") or {}).get("declared") or {}
        return {
            "strategy": manifest.get("strategy"),
            "product": manifest.get("product"),
            "job_id": manifest.get("job_id"),
            "computation_digest": manifest["provenance"].get("computation_digest"),
            "final_state_hash": manifest["provenance"].get("final_state_hash"),
            "declared_passed": declared.get("passed"),
        }
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        return {"error": f"unreadable manifest: {exc}"}
