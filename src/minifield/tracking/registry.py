"""The MLflow model registry as a mirror of the publication store.

- **publish** → a registered model version: model name = the recipe's ``product.name``;
  the artifact's files are logged into the computation's run (``store/<content-id>/``) and
  the version's source is that run path. Tags: ``minifield.content_id``,
  ``minifield.computation_digest``, ``minifield.proof_sha256``,
  ``minifield.final_state_hash``. One version per content id (found by that tag before one
  is created), so publishing again adds nothing.
- **activate / rollback** → the alias (``tracking.alias``, default ``champion``) of the model
  moves to the version of the store's ``current``. The store calls this only after its own
  gate passed and ``active.json`` moved; a refused activation never reaches the registry.
- **verify** → :meth:`RegistryMirror.disagreements` lists every way the registry and the
  store disagree about one artifact.
"""

from __future__ import annotations

import os
from typing import Any

from ..supervision import locks
from .connection import Connection, DeliveryRefused
from .delivery import Delivery
from .settings import TrackingSettings

CONTENT_ID = "minifield.content_id"


def _model_name(manifest: dict) -> str:
    product = manifest.get("product")
    name = product.get("name") if isinstance(product, dict) else product
    if not name:
        raise ValueError("the artifact's manifest names no product: no registered model name")
    return str(name)


def _version_tags(content_id: str, manifest: dict) -> dict[str, str]:
    provenance = manifest.get("provenance") or {}
    proof = provenance.get("recovery_proof") or {}
    tags = {
        CONTENT_ID: content_id,
        "minifield.computation_digest": provenance.get("computation_digest"),
        "minifield.proof_sha256": proof.get("sha256"),
        "minifield.final_state_hash": provenance.get("final_state_hash"),
        "minifield.recovery_proof_waived": provenance.get("recovery_proof_waived"),
    }
    return {k: str(v) for k, v in tags.items() if v is not None}


class RegistryMirror:
    """A :class:`minifield.store.hooks.Mirror` onto one tracking server's registry."""

    def __init__(self, settings: TrackingSettings):
        self.settings = settings
        self._delivery: Delivery | None = None

    @property
    def delivery(self) -> Delivery:
        if self._delivery is None:
            self._delivery = Delivery(Connection(self.settings))
        return self._delivery

    def _call(self, what, function, *args, **kwargs):
        return self.delivery.connection.call(what, function, *args, **kwargs)

    @property
    def _client(self):
        return self.delivery.client

    # -- lookups -----------------------------------------------------------------------------
    def version_of(self, name: str, content_id: str):
        """The model version carrying ``content_id`` (None when there is none)."""
        try:
            versions = self._call(
                "search model versions",
                self._client.search_model_versions,
                f"name = '{name}'",
            )
        except DeliveryRefused as exc:
            if exc.status == 404:
                return None
            raise
        matches = [v for v in versions if (v.tags or {}).get(CONTENT_ID) == content_id]
        return min(matches, key=lambda v: int(v.version)) if matches else None

    def alias_target(self, name: str):
        try:
            return self._call(
                "get alias",
                self._client.get_model_version_by_alias,
                name,
                self.settings.alias,
            )
        except DeliveryRefused as exc:
            if exc.status in (400, 404):  # no such model or alias
                return None
            raise

    # -- hooks -------------------------------------------------------------------------------
    def published(self, store, content_id: str) -> dict[str, Any]:
        manifest = store.manifest(content_id)
        name = _model_name(manifest)
        lock = self.delivery.state_dir / "locks" / f"version-{content_id}.lock"
        lock.parent.mkdir(parents=True, exist_ok=True)
        with locks.held(lock, {"pid": os.getpid()}, timeout_s=600.0):
            version = self.version_of(name, content_id)
            if version is None:
                version = self._create_version(store, content_id, manifest, name)
        return {"model": name, "version": version.version}

    def _create_version(self, store, content_id: str, manifest: dict, name: str):
        try:
            self._call("create registered model", self._client.create_registered_model, name)
        except DeliveryRefused as exc:
            if "RESOURCE_ALREADY_EXISTS" not in str(exc) and exc.status != 409:
                raise
        provenance = manifest.get("provenance") or {}
        facts = {
            "computation_digest": provenance.get("computation_digest"),
            "examples_digest": provenance.get("examples_digest"),
            "job_id": manifest.get("job_id"),
            "product": name,
            "code_hash": provenance.get("code_hash"),
            "source_revision": provenance.get("source_revision"),
        }
        if not facts["computation_digest"]:
            raise ValueError(f"artifact {content_id} records no computation digest")
        run_id = self.delivery.computation_run(facts)
        path = f"store/{content_id}"
        self._call(
            "log model files",
            self._client.log_artifacts,
            run_id,
            str(store.artifact_dir(content_id)),
            path,
        )
        return self._call(
            "create model version",
            self._client.create_model_version,
            name,
            f"runs:/{run_id}/{path}",
            run_id=run_id,
            tags=_version_tags(content_id, manifest),
            description=f"minifield store artifact {content_id}",
        )

    def moved(self, store, pointer: dict) -> dict[str, Any]:
        """Point the alias at the store's ``current`` (registering it first if needed)."""
        current = pointer.get("current")
        if not current:
            return {"alias": self.settings.alias, "model": None}
        name = _model_name(store.manifest(current))
        version = self.published(store, current)["version"]
        self._call(
            "set alias",
            self._client.set_registered_model_alias,
            name,
            self.settings.alias,
            version,
        )
        previous = pointer.get("previous")
        if previous and previous != current:
            # The store has one current artifact: another product's model loses the alias.
            try:
                other = _model_name(store.manifest(previous))
            except (ValueError, OSError):
                other = name
            if other != name and self.alias_target(other) is not None:
                self._call(
                    "delete alias",
                    self._client.delete_registered_model_alias,
                    other,
                    self.settings.alias,
                )
        return {"alias": self.settings.alias, "model": name, "version": version}

    def disagreements(self, store, content_id: str) -> list[str]:
        """Every way the registry disagrees with the store about ``content_id``."""
        manifest = store.manifest(content_id)
        name = _model_name(manifest)
        problems = []
        version = self.version_of(name, content_id)
        if version is None:
            problems.append(f"registered model {name!r} has no version for artifact {content_id}")
        else:
            expected = _version_tags(content_id, manifest)
            for key, value in sorted(expected.items()):
                if (version.tags or {}).get(key) != value:
                    problems.append(
                        f"model {name!r} version {version.version}: tag {key} is "
                        f"{(version.tags or {}).get(key)!r}, the store says {value!r}"
                    )
        current = store.read_pointer().get("current")
        target = self.alias_target(name)
        aliased = (target.tags or {}).get(CONTENT_ID) if target is not None else None
        alias = self.settings.alias
        if current == content_id and aliased != content_id:
            problems.append(
                f"artifact {content_id} is the store's current, but alias {alias!r} of model "
                f"{name!r} points at "
                + (f"version {target.version} ({aliased})" if target is not None else "nothing")
            )
        if current != content_id and aliased == content_id:
            problems.append(
                f"alias {alias!r} of model {name!r} points at artifact {content_id}, but the "
                f"store's current is {current}"
            )
        return problems


def mirror_for(config_path) -> RegistryMirror | None:
    """The mirror of a workflow config, or None when tracking (or its registry) is off."""
    from .settings import load

    settings = load(config_path)
    if not (settings.enabled and settings.registry):
        return None
    return RegistryMirror(settings)
