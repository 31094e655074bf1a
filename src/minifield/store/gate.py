"""The activation gate: every check an artifact must pass before ``active.json`` names it.

Activation (and rollback) trusts nothing recorded at publication time without
checking it again. Each check below is one function returning the reasons it
refuses (empty: passed); :func:`check` runs them all and refuses with every reason
at once, so a person sees the whole list, not the first failure.

1. identity: the content id is recomputed from the manifest;
2. payload: exactly the listed files, each with its size and sha256;
3. provenance: code, revision and the computation, data and final-state digests;
4. recovery proof: stored in the payload, and :func:`minifield.proof.verdict`
   accepts it for this computation;
5. declared validation: the acceptance recorded from the evaluation passed;
6. recipe: the recorded recipe still validates to the recorded digests;
7. re-evaluation: the strategy's acceptance evaluation, re-run on the published
   weights themselves, passes;
8. harness thresholds: the recipe's ``evaluation.harness.thresholds`` met by the harness
   results the manifest records, from the task files the recipe pins.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .. import atomic
from ..digest import sha256_file, sha256_json
from .errors import Refused, StoreError
from .layout import FORMAT, MANIFEST, is_sha256, payload_files

#: provenance fields activation requires: field -> what it must look like
REQUIRED_PROVENANCE = {
    "code_hash": "sha256 of the package source that trained the model",
    "source_revision": "source revision (git commit) that trained the model",
    "computation_digest": "recipe (computation) digest",
    "examples_digest": "data (examples) digest",
    "final_state_hash": "complete-state hash of the final training state",
    "recovery_proof": "recovery-proof reference (path and sha256 of proof.json)",
}
_DIGESTS = ("code_hash", "computation_digest", "examples_digest", "final_state_hash")


def check(directory: Path, content_id: str) -> dict:
    """Every activation check for the artifact in ``directory``; the report, or Refused."""
    manifest = _read_manifest(directory, content_id)
    listed = _listed_payload(manifest, directory, content_id)
    integrity = identity_reasons(manifest, content_id, directory / MANIFEST)
    integrity += payload_reasons(listed, directory)
    # Files that failed their hash are not read: the payload failure is already named.
    intact = not integrity
    recipe, recipe_problems = recorded_recipe(manifest, directory / MANIFEST)
    evaluation, acceptance, evaluation_problems = reevaluation(recipe, directory, intact)
    reasons = [
        *integrity,
        *provenance_reasons(manifest),
        *recovery_proof_reasons(manifest, listed, directory, intact),
        *declared_validation_reasons(manifest),
        *recipe_problems,
        *evaluation_problems,
        *harness_reasons(manifest, recipe),
    ]
    if reasons:
        raise Refused(content_id, reasons, evaluation)
    return {
        "content_id": content_id,
        "passed": True,
        "strategy": manifest["strategy"],
        "reevaluation": evaluation,
        "acceptance": acceptance,
        "declared": manifest["validation"]["declared"],
    }


def proof_verdict(proof: Any, computation_digest: str | None) -> list[str]:
    """Why ``proof`` does not qualify ``computation_digest``, worded for the store.

    The one verdict of the project (the training gate asks the same function).
    """
    from ..proof.verdict import (
        verdict,  # the proof machinery imports JAX; reading the store does not
    )

    return [
        f"recovery proof does not qualify this computation: {reason}"
        for reason in verdict(proof, computation_digest)
    ]


# -- what the gate cannot do without: a readable manifest that lists its payload ---------------


def _read_manifest(directory: Path, content_id: str) -> dict:
    if not directory.is_dir():
        raise Refused(content_id, [f"not published: no directory {directory}"])
    path = directory / MANIFEST
    try:
        manifest = atomic.read_json(path)
    except FileNotFoundError:
        raise Refused(content_id, [f"manifest missing: {path}"]) from None
    except ValueError as exc:
        raise Refused(content_id, [f"manifest corrupt: {path}: {exc}"]) from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise Refused(content_id, [f"manifest {path}: format is not {FORMAT!r}"])
    return manifest


def _listed_payload(manifest: dict, directory: Path, content_id: str) -> dict[str, dict]:
    payload = manifest.get("payload")
    if not isinstance(payload, list) or not all(
        isinstance(item, dict) and isinstance(item.get("path"), str) for item in payload
    ):
        raise Refused(
            content_id, [f"manifest {directory / MANIFEST}: 'payload' is not a list of files"]
        )
    return {item["path"]: item for item in payload}


# -- the checks ---------------------------------------------------------------------------------


def identity_reasons(manifest: dict, content_id: str, manifest_path: Path) -> list[str]:
    """The id is recomputed from the manifest, which lists every payload file."""
    try:
        recomputed = sha256_json(manifest)
    except ValueError as exc:  # NaN or infinity: the manifest has no canonical form
        return [f"content id mismatch: {manifest_path} has no canonical JSON ({exc})"]
    if recomputed == content_id:
        return []
    return [
        f"content id mismatch: {manifest_path} hashes to {recomputed}, not {content_id} "
        "(manifest altered after publication)"
    ]


def payload_reasons(listed: dict[str, dict], directory: Path) -> list[str]:
    """Exactly the listed files are present, each with its listed size and sha256."""
    reasons = []
    try:
        present = set(payload_files(directory)) - {MANIFEST}
    except StoreError as exc:
        present = set()
        reasons.append(f"payload unreadable: {exc}")
    for rel in sorted(set(listed) - present):
        reasons.append(f"payload file missing: {rel}")
    for rel in sorted(present - set(listed)):
        reasons.append(f"unexpected file in artifact (not in the manifest): {rel}")
    for rel in sorted(set(listed) & present):
        item, path = listed[rel], directory / rel
        size, digest = path.stat().st_size, sha256_file(path)
        if size != item.get("size") or digest != item.get("sha256"):
            reasons.append(
                f"payload file corrupt: {rel} (sha256 {digest[:16]}…, size {size}; manifest "
                f"says {str(item.get('sha256'))[:16]}…, size {item.get('size')})"
            )
    return reasons


def provenance_reasons(manifest: dict) -> list[str]:
    """Every required provenance field but the proof (its own check) is present and well-formed."""
    provenance = manifest.get("provenance") or {}
    reasons = []
    for key, meaning in REQUIRED_PROVENANCE.items():
        value = provenance.get(key)
        if key == "recovery_proof":
            continue
        well_formed = (
            is_sha256(value) if key in _DIGESTS else isinstance(value, str) and bool(value.strip())
        )
        if not well_formed:
            reasons.append(f"missing provenance: {key} ({meaning}); got {value!r}")
    return reasons


def recovery_proof_reasons(
    manifest: dict, listed: dict[str, dict], directory: Path, intact: bool
) -> list[str]:
    """The proof is referenced, stored in the payload, and qualifies this computation."""
    provenance = manifest.get("provenance") or {}
    reference = provenance.get("recovery_proof")
    if not isinstance(reference, dict) or not is_sha256(reference.get("sha256")):
        waived = provenance.get("recovery_proof_waived")
        return [
            f"missing provenance: recovery_proof ({REQUIRED_PROVENANCE['recovery_proof']})"
            + (f"; publication waived it: {waived!r}" if waived else "")
        ]
    stored_as = reference.get("stored_as")
    if stored_as not in listed or listed[stored_as].get("sha256") != reference["sha256"]:
        return [
            f"recovery proof {stored_as!r} is not in the payload with sha256 {reference['sha256']}"
        ]
    if not intact:
        return []
    try:
        proof = atomic.read_json(directory / stored_as)
    except ValueError as exc:
        return [f"recovery proof {stored_as} is not valid JSON ({exc})"]
    return proof_verdict(proof, provenance.get("computation_digest"))


def declared_validation_reasons(manifest: dict) -> list[str]:
    """The validation declared at publication (the evaluation's acceptance) passed."""
    declared = (manifest.get("validation") or {}).get("declared")
    if not isinstance(declared, dict) or "passed" not in declared:
        return ["missing declared validation (acceptance from the evaluation metrics)"]
    if declared.get("passed") is True:
        return []
    failed = [
        f"{c.get('name')}={c.get('value')!r} (threshold {c.get('threshold')!r})"
        for c in declared.get("checks", [])
        if not c.get("passed")
    ]
    return ["declared validation failed: " + (", ".join(failed) or "passed=false")]


def recorded_recipe(manifest: dict, manifest_path: Path) -> tuple[Any, list[str]]:
    """The recorded recipe, validated again: (the recipe or None, reasons).

    It must still validate, to the digests the provenance records, with the strategy
    the manifest names; the re-evaluation needs it.
    """
    if not isinstance(manifest.get("recipe"), dict):
        return None, ["missing provenance: recipe (the validated recipe is needed to re-evaluate)"]
    from .. import recipe as recipes  # imports the strategies (and JAX) only when needed

    try:
        recipe = recipes.validate(manifest["recipe"], f"{manifest_path}#/recipe")
    except recipes.RecipeError as exc:
        return None, [f"recorded recipe no longer validates: {exc}"]
    provenance = manifest.get("provenance") or {}
    reasons = [
        f"recorded recipe has {key} {value}, provenance says {provenance[key]}"
        for key, value in (
            ("computation_digest", recipe.computation_digest),
            ("examples_digest", recipe.examples_digest),
        )
        if provenance.get(key) and provenance[key] != value
    ]
    strategy = manifest.get("strategy") or {}
    if (strategy.get("name"), strategy.get("version")) != (
        recipe.strategy.name,
        recipe.strategy.version,
    ):
        reasons.append(f"manifest strategy {strategy} does not match the recipe's")
    return recipe, reasons


def reevaluation(recipe, directory: Path, intact: bool) -> tuple[Any, Any, list[str]]:
    """Re-run the strategy's acceptance evaluation on the published weights themselves:
    (evaluation, acceptance, reasons)."""
    if recipe is None:
        return None, None, []  # the recipe check has said why
    if not intact:
        return (
            None,
            None,
            ["acceptance re-evaluation skipped: the payload failed its integrity checks"],
        )
    try:
        evaluation = recipe.strategy.evaluate_export(recipe.data, directory)
        acceptance = recipe.strategy.acceptance(recipe.data, evaluation)
    except Exception as exc:  # noqa: BLE001 - any failure to evaluate is a failed gate
        return None, None, [f"acceptance re-evaluation could not run: {type(exc).__name__}: {exc}"]
    if acceptance.get("passed"):
        return evaluation, acceptance, []
    failed = [
        f"{c.get('name')}={c.get('value')!r} > threshold {c.get('threshold')!r}"
        if isinstance(c.get("value"), (int, float))
        else f"{c.get('name')}={c.get('value')!r} (threshold {c.get('threshold')!r})"
        for c in acceptance.get("checks", [])
        if not c.get("passed")
    ]
    return (
        evaluation,
        acceptance,
        [
            "acceptance re-evaluation failed on the published weights: "
            + (", ".join(failed) or "passed=false")
        ],
    )


def harness_reasons(manifest: dict, recipe) -> list[str]:
    """The recipe's harness thresholds, checked again against the results the manifest
    records (run from the task files the recipe pins): the reasons they fail."""
    from ..harness import tasks, thresholds

    harness = tasks.section(recipe.data) if recipe is not None else None
    if not harness or not harness.get("thresholds"):
        return []
    recorded = (manifest.get("validation") or {}).get("harness")
    if not isinstance(recorded, dict) or not isinstance(recorded.get("results"), dict):
        return ["harness thresholds set, but the artifact records no harness results"]
    if recorded.get("tasks") != tasks.pinned_sha256(recipe.data):
        return ["harness results were not computed from the task files the recipe pins"]
    return [
        f"harness threshold failed: {c['name']}={c['value']!r} (at least {c['threshold']!r})"
        for c in thresholds.checks(harness["thresholds"], recorded["results"])
        if not c["passed"]
    ]
