"""The manifest of an artifact: what is published, where it came from, what it claims.

The manifest lists every payload file with its sha256 and size, the provenance
(code, recipe and data digests, final state, recovery proof), the declared
validation and the validated recipe. Its canonical-JSON sha256 is the artifact's
content id, so the id covers every published byte. It holds no time stamps:
publishing the same content twice yields the same id.

Absent provenance sources are recorded as null (activation then refuses);
sources that contradict each other are refused here, and so is a recovery proof
that does not qualify the recipe's computation.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .. import atomic
from ..digest import sha256_bytes, sha256_file, sha256_json
from ..state import export
from . import gate
from .errors import Refused, StoreError
from .gate import REQUIRED_PROVENANCE
from .layout import FORMAT, MANIFEST, PROOF_EVIDENCE, payload_files


def content_id(manifest: dict) -> str:
    """The artifact's id: the sha256 of the manifest's canonical JSON."""
    return sha256_json(manifest)


def build(
    export_dir: Path,
    *,
    recipe_json: Path | None = None,
    train_result: Path | None = None,
    metrics: Path | None = None,
    proof: Path | None = None,
    no_proof: str | None = None,
) -> dict:
    """The manifest for publishing ``export_dir``.

    Raises StoreError on incoherent inputs and Refused when the proof does not
    qualify the computation.
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
    payload = _payload(export_dir)
    recipe = _load_recipe(recipe_json)
    provenance = _provenance(recipe, recipe_json, train_result)
    validation = _validation(metrics, provenance)
    evidence = []
    if proof is not None:
        evidence.append(_proof_evidence(Path(proof), provenance))
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


def _payload(export_dir: Path) -> list[dict]:
    payload = [
        {
            "path": rel,
            "sha256": sha256_file(export_dir / rel),
            "size": (export_dir / rel).stat().st_size,
        }
        for rel in payload_files(export_dir)
    ]
    if any(item["path"].startswith("evidence/") or item["path"] == MANIFEST for item in payload):
        raise StoreError(f"{export_dir}: contains 'evidence/' or '{MANIFEST}' (reserved names)")
    return payload


def _load_recipe(recipe_json: Path | None):
    if recipe_json is None:
        return None
    from .. import recipe as recipes  # imports the strategies (and JAX) only when needed

    try:
        return recipes.load(recipe_json)
    except recipes.RecipeError as exc:
        raise StoreError(str(exc)) from exc


def _provenance(recipe, recipe_json: Path | None, train_result: Path | None) -> dict[str, Any]:
    """Provenance from the recipe and the train result, which must agree."""
    provenance: dict[str, Any] = {key: None for key in REQUIRED_PROVENANCE}
    provenance.update({"package_version": None, "environment": None, "train_result": None})
    if recipe is not None:
        provenance["computation_digest"] = recipe.computation_digest
        provenance["examples_digest"] = recipe.examples_digest
    if train_result is None:
        return provenance
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
    return provenance


def _validation(metrics: Path | None, provenance: dict) -> dict[str, Any]:
    """The declared validation: the acceptance of the evaluation metrics of this very run."""
    if metrics is None:
        return {"declared": None, "source": None}
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
        "covers_payload": evaluated is not None and evaluated == provenance["final_state_hash"],
    }
    if "harness" in document:  # the harness results the gate re-checks the thresholds against
        harness = document["harness"]
        validation["harness"] = {k: harness.get(k) for k in ("results", "tasks", "samples")}
    return validation


def _proof_evidence(proof: Path, provenance: dict) -> dict:
    """Record ``proof`` in the provenance; its payload entry. Refuses a proof that does not
    qualify the computation (when the computation is known: without a recipe or train
    result activation refuses anyway, for the missing computation digest)."""
    data = proof.read_bytes()
    try:
        document = atomic.read_json(proof)
    except ValueError as exc:
        raise StoreError(f"{proof}: not valid JSON ({exc})") from exc
    if provenance["computation_digest"]:
        reasons = gate.proof_verdict(document, provenance["computation_digest"])
        if reasons:
            raise Refused(None, [f"{proof}: {reason}" for reason in reasons])
    provenance["recovery_proof"] = {
        "path": str(proof),
        "sha256": sha256_bytes(data),
        "stored_as": PROOF_EVIDENCE,
    }
    return {"path": PROOF_EVIDENCE, "sha256": sha256_bytes(data), "size": len(data)}
