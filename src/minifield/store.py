"""The publication store: content-addressed artifacts and a gated, reversible ``active.json``.

Layout of a store directory::

    DIR/artifacts/<content-id>/manifest.json   provenance, declared validation, recipe, payload list
    DIR/artifacts/<content-id>/model.json      the exported model (payload) ...
    DIR/artifacts/<content-id>/weights/*.npy   ... and its weights (payload)
    DIR/artifacts/<content-id>/evidence/proof.json   copy of the recovery proof (payload)
    DIR/active.json                            {current, previous, history}
    DIR/.lock                                  single-writer lock (fcntl)

The content id is the sha256 of the canonical JSON of the manifest, and the
manifest lists every payload file with its sha256 and size, so the id covers
every byte that is published. The manifest holds no time stamps: publishing the
same content twice yields the same id.

Publishing never activates. Activation (and rollback, which is an activation of
``previous``) trusts nothing recorded at publication time without checking it
again: it recomputes the id from the files, re-hashes every payload file,
checks the required provenance and the declared validation, re-validates the
recipe against the recorded digests, and re-runs the strategy's acceptance
evaluation on the published weights. Only when all of that passes does it
replace ``active.json`` atomically; any failure leaves it byte-for-byte as it was.

This is a trusted, single-writer local store: checksums detect accidental
corruption, they do not authenticate an adversarial writer, and a boolean
validation record is not a signed attestation.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import fcntl
import os
import re
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from . import atomic, export
from .digest import canonical_json, sha256_bytes, sha256_file, sha256_json

FORMAT = "minifield-artifact/1"
POINTER_FORMAT = "minifield-store-pointer/1"
ARTIFACTS = "artifacts"
MANIFEST = "manifest.json"
POINTER = "active.json"
LOCK = ".lock"
PROOF_EVIDENCE = "evidence/proof.json"
#: files a directory() output of Snakemake gains; never part of a payload
EXCLUDED_NAMES = frozenset({".snakemake_timestamp"})
DEFAULT_DIR = "results/store"

_HEX64 = re.compile(r"^[0-9a-f]{64}$")

#: provenance fields activation requires: field -> what it must look like
REQUIRED_PROVENANCE = {
    "code_hash": "sha256 of the package source that trained the model",
    "source_revision": "source revision (git commit) that trained the model",
    "computation_digest": "recipe (computation) digest",
    "examples_digest": "data (examples) digest",
    "final_state_hash": "complete-state hash of the final training state",
    "recovery_proof": "recovery-proof reference (path and sha256 of proof.json)",
}


class StoreError(Exception):
    """A request the store cannot carry out (bad input, unknown id); exit 2."""


class Refused(StoreError):
    """Activation/verification refused; ``reasons`` names every failed check; exit 1."""

    def __init__(self, content_id: str | None, reasons: list[str]):
        self.content_id = content_id
        self.reasons = reasons
        super().__init__(
            f"refused {content_id or ''}: " + "; ".join(reasons) if reasons else "refused"
        )


class LockTimeout(StoreError):
    """Another writer holds the store lock for longer than the timeout; exit 3."""


def _now_iso() -> str:
    return dt.datetime.now(dt.UTC).isoformat(timespec="milliseconds")


def _payload_files(directory: Path) -> list[str]:
    """Relative posix paths of the regular files under ``directory`` (sorted)."""
    files = []
    for path in sorted(directory.rglob("*")):
        if path.name in EXCLUDED_NAMES:
            continue
        if path.is_symlink():
            raise StoreError(f"{path}: symbolic links are not published (copy the file instead)")
        if path.is_file():
            files.append(path.relative_to(directory).as_posix())
    return files


def _proof_verdict(proof: Any) -> tuple[bool, str]:
    """(passed, why) for a recovery proof document.

    A proof passes when it says so (``passed: true`` or ``status: "passed"``)
    and reports no divergence; anything else is not a passing proof.
    """
    if not isinstance(proof, dict):
        return False, "proof.json is not a JSON object"
    if proof.get("first_divergence") not in (None, {}, []):
        return False, f"proof reports a divergence: {proof['first_divergence']!r}"
    if proof.get("passed") is True or proof.get("status") in ("passed", "pass"):
        return True, str(proof.get("diagnosis", "passed"))
    return False, (
        "proof does not state that it passed "
        f"(passed={proof.get('passed')!r}, status={proof.get('status')!r}, "
        f"diagnosis={proof.get('diagnosis')!r})"
    )


class Store:
    def __init__(self, root: str | Path, lock_timeout: float | None = 60.0):
        self.root = Path(root)
        self.lock_timeout = lock_timeout

    # -- locations ----------------------------------------------------------------------
    @property
    def artifacts(self) -> Path:
        return self.root / ARTIFACTS

    @property
    def pointer_path(self) -> Path:
        return self.root / POINTER

    def artifact_dir(self, content_id: str) -> Path:
        if not _HEX64.match(content_id or ""):
            raise StoreError(f"{content_id!r} is not a content id (64 lower-case hex characters)")
        return self.artifacts / content_id

    # -- the single-writer lock -----------------------------------------------------------
    @contextlib.contextmanager
    def lock(self):
        """Exclusive fcntl lock on DIR/.lock; waits up to ``lock_timeout`` seconds (None: forever).

        The lock is released by the kernel when the process ends, however it ends,
        so a crashed writer never leaves the store locked.
        """
        self.root.mkdir(parents=True, exist_ok=True)
        handle = open(self.root / LOCK, "a+", encoding="utf-8")
        try:
            deadline = None if self.lock_timeout is None else time.monotonic() + self.lock_timeout
            while True:
                try:
                    fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if deadline is not None and time.monotonic() >= deadline:
                        handle.seek(0)
                        holder = handle.read().strip() or "unknown"
                        raise LockTimeout(
                            f"store {self.root} is locked by another writer ({holder}); gave up "
                            f"after {self.lock_timeout:g} s (use --lock-timeout to wait longer)"
                        ) from None
                    time.sleep(0.05)
            handle.seek(0)
            handle.truncate()
            handle.write(f"pid {os.getpid()} since {_now_iso()}\n")
            handle.flush()
            yield
        finally:
            handle.close()  # closing the descriptor releases the lock

    # -- publish --------------------------------------------------------------------------
    def build_manifest(
        self,
        export_dir: Path,
        *,
        recipe_json: Path | None = None,
        train_result: Path | None = None,
        metrics: Path | None = None,
        proof: Path | None = None,
        no_proof: str | None = None,
    ) -> dict:
        """The manifest for publishing ``export_dir``; raises StoreError on incoherent inputs.

        Absent provenance sources are recorded as null (and activation will
        refuse); sources that contradict each other are refused here.
        """
        export_dir = Path(export_dir)
        if not export_dir.is_dir():
            raise StoreError(f"{export_dir}: not a directory (expected an export directory)")
        try:
            _, model_config = export.read(export_dir)
        except export.ExportError as exc:
            raise StoreError(f"cannot publish {export_dir}: {exc}") from exc
        if proof is None and no_proof is None:
            raise StoreError(
                "a recovery proof is required: pass --proof PROOF_JSON, or --no-proof REASON to "
                "publish without one explicitly (such an artifact can never be activated)"
            )
        payload = [
            {
                "path": rel,
                "sha256": sha256_file(export_dir / rel),
                "size": (export_dir / rel).stat().st_size,
            }
            for rel in _payload_files(export_dir)
        ]
        if any(
            item["path"].startswith("evidence/") or item["path"] == MANIFEST for item in payload
        ):
            raise StoreError(f"{export_dir}: contains 'evidence/' or '{MANIFEST}' (reserved names)")

        from . import recipe as recipes  # imports the strategies (and JAX) only when needed

        recipe = None
        if recipe_json is not None:
            try:
                recipe = recipes.load(recipe_json)
            except recipes.RecipeError as exc:
                raise StoreError(str(exc)) from exc

        provenance: dict[str, Any] = {key: None for key in REQUIRED_PROVENANCE}
        provenance.update({"package_version": None, "environment": None, "train_result": None})
        if recipe is not None:
            provenance["computation_digest"] = recipe.computation_digest
            provenance["examples_digest"] = recipe.examples_digest
        if train_result is not None:
            result = atomic.read_json(train_result)
            if result.get("status") != "completed":
                raise StoreError(
                    f"{train_result}: status {result.get('status')!r}; only a completed training "
                    "run can be published"
                )
            for key in ("computation_digest", "examples_digest"):
                if recipe is not None and result.get(key) != provenance[key]:
                    raise StoreError(
                        f"{train_result}: {key} {result.get(key)} does not match the recipe "
                        f"{recipe_json} ({provenance[key]})"
                    )
                provenance[key] = result.get(key)
            environment = result.get("environment") or {}
            provenance["code_hash"] = environment.get("code_hash")
            provenance["source_revision"] = environment.get("source_revision")
            provenance["package_version"] = environment.get("package_version")
            provenance["final_state_hash"] = result.get("final_state_hash")
            provenance["environment"] = {
                k: environment.get(k)
                for k in ("python", "jax", "jaxlib", "optax", "backend", "device_kind")
            }
            provenance["train_result"] = {
                "path": str(train_result),
                "sha256": sha256_file(train_result),
                "job_id": result.get("job_id"),
                "attempt_id": result.get("attempt_id"),
                "steps_completed": result.get("steps_completed"),
            }

        validation: dict[str, Any] = {"declared": None, "source": None}
        if metrics is not None:
            document = atomic.read_json(metrics)
            if (
                provenance["computation_digest"]
                and document.get("computation_digest") != provenance["computation_digest"]
            ):
                raise StoreError(
                    f"{metrics}: computation_digest {document.get('computation_digest')} does not "
                    f"match the recipe/train result ({provenance['computation_digest']})"
                )
            if (
                provenance["final_state_hash"]
                and document.get("final_state_hash") != provenance["final_state_hash"]
            ):
                raise StoreError(
                    f"{metrics}: final_state_hash does not match the train result "
                    "(the metrics belong to another run)"
                )
            selection = document.get("selection") or {}
            evaluated = next(
                (
                    row.get("state_hash")
                    for row in document.get("checkpoints", [])
                    if row.get("step") is not None and row.get("step") == selection.get("step")
                ),
                None,
            )
            validation = {
                "declared": document.get("acceptance"),
                "source": {"path": str(metrics), "sha256": sha256_file(metrics)},
                "selection": selection,
                "evaluated_state_hash": evaluated,
                # True when the DEV-selected checkpoint is the exported final state; either
                # way activation re-runs acceptance on the published weights themselves.
                "covers_payload": evaluated is not None
                and evaluated == provenance["final_state_hash"],
            }

        evidence = []
        if proof is not None:
            data = Path(proof).read_bytes()
            try:
                atomic.read_json(proof)
            except ValueError as exc:
                raise StoreError(f"{proof}: not valid JSON ({exc})") from exc
            provenance["recovery_proof"] = {
                "path": str(proof),
                "sha256": sha256_bytes(data),
                "stored_as": PROOF_EVIDENCE,
            }
            evidence.append(
                {"path": PROOF_EVIDENCE, "sha256": sha256_bytes(data), "size": len(data)}
            )
        provenance["recovery_proof_waived"] = None if proof is not None else no_proof

        strategy = (
            {"name": recipe.strategy.name, "version": recipe.strategy.version}
            if recipe is not None
            else {"name": model_config.get("strategy"), "version": None}
        )
        return {
            "format": FORMAT,
            "strategy": strategy,
            "product": recipe.data.get("product") if recipe is not None else None,
            "job_id": recipe.job_id if recipe is not None else None,
            "payload": sorted(payload + evidence, key=lambda item: item["path"]),
            "provenance": provenance,
            "validation": validation,
            "recipe": recipe.data if recipe is not None else None,
        }

    def publish(self, export_dir: Path, **sources) -> tuple[str, bool]:
        """Copy the export into ``artifacts/<content-id>/``; returns (content id, newly created).

        Never touches ``active.json``. Writes into a staging directory and
        renames it into place, so an artifact directory is either complete or absent.
        """
        manifest = self.build_manifest(Path(export_dir), **sources)
        content_id = sha256_json(manifest)
        with self.lock():
            target = self.artifacts / content_id
            if target.is_dir():
                return content_id, False
            self.artifacts.mkdir(parents=True, exist_ok=True)
            staging = Path(tempfile.mkdtemp(prefix=".staging-", dir=self.artifacts))
            try:
                for item in manifest["payload"]:
                    source = (
                        Path(sources["proof"])
                        if item["path"] == PROOF_EVIDENCE
                        else Path(export_dir) / item["path"]
                    )
                    destination = staging / item["path"]
                    destination.parent.mkdir(parents=True, exist_ok=True)
                    shutil.copyfile(source, destination)
                    # Re-hash the copy: a file changing under us must not publish a wrong id.
                    if sha256_file(destination) != item["sha256"]:
                        raise StoreError(f"{source}: changed while being published; try again")
                    with open(destination, "rb") as handle:
                        os.fsync(handle.fileno())
                atomic.write_json(staging / MANIFEST, manifest)
                os.replace(staging, target)
                atomic.fsync_dir(self.artifacts)
            except BaseException:
                shutil.rmtree(staging, ignore_errors=True)
                raise
        return content_id, True

    # -- read -----------------------------------------------------------------------------
    def manifest(self, content_id: str) -> dict:
        path = self.artifact_dir(content_id) / MANIFEST
        if not path.is_file():
            raise StoreError(f"no artifact {content_id} in {self.artifacts} (missing {path})")
        return atomic.read_json(path)

    def read_pointer(self) -> dict:
        """The pointer, or an empty one when nothing was ever activated."""
        if not self.pointer_path.exists():
            return {"format": POINTER_FORMAT, "current": None, "previous": None, "history": []}
        try:
            pointer = atomic.read_json(self.pointer_path)
        except ValueError as exc:
            raise StoreError(
                f"{self.pointer_path}: unreadable ({exc}); refusing to overwrite it"
            ) from exc
        if not isinstance(pointer, dict) or not isinstance(pointer.get("history"), list):
            raise StoreError(f"{self.pointer_path}: not a store pointer; refusing to overwrite it")
        return pointer

    def list(self) -> list[dict]:
        pointer = self.read_pointer()
        rows = []
        if not self.artifacts.is_dir():
            return rows
        for entry in sorted(self.artifacts.iterdir()):
            if not _HEX64.match(entry.name):
                continue
            row: dict[str, Any] = {"content_id": entry.name}
            try:
                manifest = atomic.read_json(entry / MANIFEST)
                declared = (manifest.get("validation") or {}).get("declared") or {}
                row.update(
                    {
                        "strategy": manifest.get("strategy"),
                        "product": manifest.get("product"),
                        "job_id": manifest.get("job_id"),
                        "computation_digest": manifest["provenance"].get("computation_digest"),
                        "final_state_hash": manifest["provenance"].get("final_state_hash"),
                        "declared_passed": declared.get("passed"),
                    }
                )
            except (OSError, ValueError, KeyError, TypeError) as exc:
                row["error"] = f"unreadable manifest: {exc}"
            row["active"] = (
                "current"
                if entry.name == pointer.get("current")
                else "previous"
                if entry.name == pointer.get("previous")
                else None
            )
            rows.append(row)
        return rows

    # -- the gate -------------------------------------------------------------------------
    def check(self, content_id: str) -> dict:
        """Every activation check for ``content_id``; returns the report or raises Refused."""
        directory = self.artifact_dir(content_id)
        if not directory.is_dir():
            raise Refused(content_id, [f"not published: no directory {directory}"])
        reasons: list[str] = []
        manifest_path = directory / MANIFEST
        try:
            manifest = atomic.read_json(manifest_path)
        except FileNotFoundError:
            raise Refused(content_id, [f"manifest missing: {manifest_path}"]) from None
        except ValueError as exc:
            raise Refused(content_id, [f"manifest corrupt: {manifest_path}: {exc}"]) from None
        if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
            raise Refused(content_id, [f"manifest {manifest_path}: format is not {FORMAT!r}"])

        # 1. identity: the id is recomputed from the manifest, which lists every payload file.
        recomputed = sha256_bytes(canonical_json(manifest).encode("utf-8"))
        if recomputed != content_id:
            reasons.append(
                f"content id mismatch: {manifest_path} hashes to {recomputed}, not {content_id} "
                "(manifest altered after publication)"
            )

        # 2. payload integrity: exactly the listed files, each with its size and sha256.
        payload = manifest.get("payload")
        if not isinstance(payload, list) or not all(
            isinstance(item, dict) and isinstance(item.get("path"), str) for item in payload
        ):
            raise Refused(
                content_id, [f"manifest {manifest_path}: 'payload' is not a list of files"]
            )
        listed = {item["path"]: item for item in payload}
        try:
            present = set(_payload_files(directory)) - {MANIFEST}
        except StoreError as exc:
            present = set()
            reasons.append(f"payload unreadable: {exc}")
        for rel in sorted(set(listed) - present):
            reasons.append(f"payload file missing: {rel}")
        for rel in sorted(present - set(listed)):
            reasons.append(f"unexpected file in artifact (not in the manifest): {rel}")
        for rel in sorted(set(listed) & present):
            item, path = listed[rel], directory / rel
            size = path.stat().st_size
            digest = sha256_file(path)
            if size != item.get("size") or digest != item.get("sha256"):
                reasons.append(
                    f"payload file corrupt: {rel} (sha256 {digest[:16]}…, size {size}; manifest "
                    f"says {str(item.get('sha256'))[:16]}…, size {item.get('size')})"
                )
        intact = not reasons

        # 3. required provenance.
        provenance = manifest.get("provenance") or {}
        for key, meaning in REQUIRED_PROVENANCE.items():
            value = provenance.get(key)
            if key == "recovery_proof":
                if not isinstance(value, dict) or not _HEX64.match(str(value.get("sha256"))):
                    waived = provenance.get("recovery_proof_waived")
                    reasons.append(
                        f"missing provenance: {key} ({meaning})"
                        + (f"; publication waived it: {waived!r}" if waived else "")
                    )
                elif value.get("stored_as") not in listed or (
                    listed[value["stored_as"]].get("sha256") != value["sha256"]
                ):
                    reasons.append(
                        f"recovery proof {value.get('stored_as')!r} is not in the payload with "
                        f"sha256 {value['sha256']}"
                    )
                elif intact:
                    passed, why = _proof_verdict(atomic.read_json(directory / value["stored_as"]))
                    if not passed:
                        reasons.append(f"recovery proof does not pass: {why}")
            elif key in ("code_hash", "computation_digest", "examples_digest", "final_state_hash"):
                if not _HEX64.match(str(value)):
                    reasons.append(f"missing provenance: {key} ({meaning}); got {value!r}")
            elif not isinstance(value, str) or not value.strip():
                reasons.append(f"missing provenance: {key} ({meaning}); got {value!r}")

        # 4. declared validation.
        validation = manifest.get("validation") or {}
        declared = validation.get("declared")
        if not isinstance(declared, dict) or "passed" not in declared:
            reasons.append("missing declared validation (acceptance from the evaluation metrics)")
        elif declared.get("passed") is not True:
            failed = [
                f"{c.get('name')}={c.get('value')!r} (threshold {c.get('threshold')!r})"
                for c in declared.get("checks", [])
                if not c.get("passed")
            ]
            reasons.append("declared validation failed: " + (", ".join(failed) or "passed=false"))

        # 5. the recipe must still validate to the recorded digests.
        from . import recipe as recipes  # imports the strategies (and JAX) only when needed

        recipe = None
        if not isinstance(manifest.get("recipe"), dict):
            reasons.append(
                "missing provenance: recipe (the validated recipe is needed to re-evaluate)"
            )
        else:
            try:
                recipe = recipes.validate(manifest["recipe"], f"{manifest_path}#/recipe")
            except recipes.RecipeError as exc:
                reasons.append(f"recorded recipe no longer validates: {exc}")
            if recipe is not None:
                for key, value in (
                    ("computation_digest", recipe.computation_digest),
                    ("examples_digest", recipe.examples_digest),
                ):
                    if provenance.get(key) and provenance[key] != value:
                        reasons.append(
                            f"recorded recipe has {key} {value}, provenance says {provenance[key]}"
                        )
                strategy = manifest.get("strategy") or {}
                if (strategy.get("name"), strategy.get("version")) != (
                    recipe.strategy.name,
                    recipe.strategy.version,
                ):
                    reasons.append(f"manifest strategy {strategy} does not match the recipe's")

        # 6. re-run the acceptance evaluation on the published weights themselves.
        evaluation = acceptance = None
        if recipe is not None and intact:
            try:
                evaluation = recipe.strategy.evaluate_export(recipe.data, directory)
                acceptance = recipe.strategy.acceptance(recipe.data, evaluation)
            except Exception as exc:  # noqa: BLE001 - any failure to evaluate is a failed gate
                reasons.append(
                    f"acceptance re-evaluation could not run: {type(exc).__name__}: {exc}"
                )
            else:
                if not acceptance.get("passed"):
                    failed = [
                        f"{c.get('name')}={c.get('value')!r} > threshold {c.get('threshold')!r}"
                        if isinstance(c.get("value"), (int, float))
                        else f"{c.get('name')}={c.get('value')!r} (threshold {c.get('threshold')!r})"
                        for c in acceptance.get("checks", [])
                        if not c.get("passed")
                    ]
                    reasons.append(
                        "acceptance re-evaluation failed on the published weights: "
                        + (", ".join(failed) or "passed=false")
                    )
        elif recipe is not None:
            reasons.append(
                "acceptance re-evaluation skipped: the payload failed its integrity checks"
            )

        if reasons:
            raise Refused(content_id, reasons)
        return {
            "content_id": content_id,
            "passed": True,
            "strategy": manifest["strategy"],
            "reevaluation": evaluation,
            "acceptance": acceptance,
            "declared": declared,
        }

    # -- moves of the pointer -------------------------------------------------------------
    def _move(self, action: str, target: str | None) -> dict:
        """Check ``target`` (``None`` for rollback: the pointer's ``previous``) and move to it.

        Runs entirely under the lock, so the pointer read here is the one replaced.
        """
        with self.lock():
            before = self.read_pointer()
            if action == "rollback":
                target = before.get("previous")
                if not target:
                    raise Refused(
                        None, [f"nothing to roll back to: {self.pointer_path} has no previous"]
                    )
            report = self.check(target)
            if target == before.get("current"):
                return {**report, "action": action, "changed": False, "pointer": before}
            history = list(before.get("history", []))
            move = {
                "seq": len(history),
                "action": action,
                "from": before.get("current"),
                "to": target,
                "time": _now_iso(),
                "pid": os.getpid(),
                "acceptance": report["acceptance"],
            }
            after = {
                "format": POINTER_FORMAT,
                "current": target,
                "previous": before.get("current"),
                "history": [*history, move],
            }
            atomic.write_json(self.pointer_path, after)
            return {**report, "action": action, "changed": True, "pointer": after}

    def activate(self, content_id: str) -> dict:
        self.artifact_dir(content_id)  # rejects a malformed id before taking the lock
        return self._move("activate", content_id)

    def rollback(self) -> dict:
        return self._move("rollback", None)


# -- pipeline entry points ----------------------------------------------------------------------


def publish_computation(
    store_dir: Path,
    export_dir: Path,
    recipe_json: Path,
    train_result: Path,
    metrics: Path,
    proof: Path | None,
    out_publication: Path,
    *,
    no_proof: str | None = None,
    lock_timeout: float | None = 600.0,
) -> dict:
    """The ``publish`` rule: publish one computation's export and write ``publication.json``."""
    store = Store(store_dir, lock_timeout=lock_timeout)
    content_id, created = store.publish(
        export_dir,
        recipe_json=recipe_json,
        train_result=train_result,
        metrics=metrics,
        proof=proof,
        no_proof=no_proof,
    )
    manifest = store.manifest(content_id)
    provenance = manifest["provenance"]
    record = {
        "content_id": content_id,
        "newly_published": created,
        "store": str(store_dir),
        "artifact_dir": str(store.artifact_dir(content_id)),
        "manifest_path": str(store.artifact_dir(content_id) / MANIFEST),
        "strategy": manifest["strategy"],
        "product": manifest["product"],
        "provenance": {
            key: provenance.get(key)
            for key in (
                "code_hash",
                "source_revision",
                "computation_digest",
                "examples_digest",
                "final_state_hash",
                "recovery_proof",
                "recovery_proof_waived",
            )
        },
        "declared_validation": manifest["validation"].get("declared"),
        "validation_covers_payload": manifest["validation"].get("covers_payload"),
        "activated": False,
    }
    atomic.write_json(out_publication, record)
    return record


def activate_publication(
    store_dir: Path, publication: Path, out_activation: Path, *, lock_timeout: float | None = 600.0
) -> dict:
    """The optional ``activate`` rule: activate a published computation through the full gate."""
    content_id = atomic.read_json(publication)["content_id"]
    report = Store(store_dir, lock_timeout=lock_timeout).activate(content_id)
    record = {
        "content_id": content_id,
        "changed": report["changed"],
        "current": report["pointer"]["current"],
        "previous": report["pointer"]["previous"],
        "reevaluation": report["reevaluation"],
        "acceptance": report["acceptance"],
        "time": _now_iso(),
    }
    atomic.write_json(out_activation, record)
    return record
