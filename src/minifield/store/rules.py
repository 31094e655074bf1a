"""The pipeline's store rules: ``publish`` (every computation) and ``activate`` (optional)."""

from __future__ import annotations

from pathlib import Path

from .. import atomic
from .layout import MANIFEST
from .pointer import now_iso
from .store import Store


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
    mirror=None,
) -> dict:
    """The ``publish`` rule: publish one computation's export and write ``publication.json``.

    ``mirror``: the model registry to tell (:mod:`.hooks`); its report is ``registry``."""
    store = Store(store_dir, lock_timeout=lock_timeout, mirror=mirror)
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
    if store.mirror_report is not None:
        record["registry"] = store.mirror_report
    atomic.write_json(out_publication, record)
    return record


def activate_publication(
    store_dir: Path,
    publication: Path,
    out_activation: Path,
    *,
    lock_timeout: float | None = 600.0,
    mirror=None,
) -> dict:
    """The optional ``activate`` rule: activate a published computation through the full gate."""
    content_id = atomic.read_json(publication)["content_id"]
    store = Store(store_dir, lock_timeout=lock_timeout, mirror=mirror)
    report = store.activate(content_id)
    record = {
        "content_id": content_id,
        "changed": report["changed"],
        "current": report["pointer"]["current"],
        "previous": report["pointer"]["previous"],
        "reevaluation": report["reevaluation"],
        "acceptance": report["acceptance"],
        "time": now_iso(),
    }
    if store.mirror_report is not None:
        record["registry"] = store.mirror_report
    atomic.write_json(out_activation, record)
    return record
