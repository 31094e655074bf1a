"""The ``tracking`` section of the workflow config, checked once, with its defaults."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from ..digest import sha256_json
from ..inputs import origins

DEFAULT_EXPERIMENT = "minifield"
DEFAULT_ALIAS = "champion"
DEFAULT_STATE_DIR = "work/tracking"


class SettingsError(ValueError):
    """A tracking setting that cannot be used; names the config field."""


@dataclass(frozen=True)
class TrackingSettings:
    """Where and how runs are delivered. ``state_dir`` holds the delivery cursors and locks."""

    enabled: bool = False
    uri: str | None = None
    experiment: str = DEFAULT_EXPERIMENT
    alias: str = DEFAULT_ALIAS
    credentials: Path | None = None
    ca_bundle: Path | None = None
    state_dir: Path = Path(DEFAULT_STATE_DIR)
    request_timeout_s: float = 30.0
    max_retry_wait_s: float = 300.0
    registry: bool = True

    @property
    def origin(self) -> str:
        return origins.of_url(self.uri)

    @property
    def destination(self) -> str:
        """The server and experiment runs are delivered to, as a 16-hex key: the deliver rule's
        output and the delivery cursors are per destination, so pointing ``uri`` (or
        ``experiment``) elsewhere delivers everything there again."""
        return sha256_json({"uri": self.uri, "experiment": self.experiment})[:16]

    @property
    def destination_state_dir(self) -> Path:
        """Cursors and locks of this destination: ``state_dir/destinations/<destination>``."""
        return Path(self.state_dir) / "destinations" / self.destination


def from_config(
    config: Mapping[str, Any] | None, source: str = "config/config.yaml"
) -> TrackingSettings:
    """``TrackingSettings`` from a whole workflow config (its ``tracking`` section).

    Refuses (naming ``tracking.<field>`` and ``source``) what cannot work: no uri when
    enabled, a scheme other than http(s), a credentials file with plain http to a host that
    is not loopback (the token would travel in the clear), a missing CA bundle.
    """
    section = (config or {}).get("tracking") or {}
    if not isinstance(section, Mapping):
        raise SettingsError(f"{source}: tracking must be a mapping, got {type(section).__name__}")
    known = {f for f in TrackingSettings.__dataclass_fields__}
    unknown = sorted(set(section) - known)
    if unknown:
        raise SettingsError(
            f"{source}: tracking: unknown field(s) {unknown}; known: {sorted(known)}"
        )

    def field(name, kind, default):
        value = section.get(name)
        if value is None:  # absent, or null (the schema's default for optional paths)
            return default
        if not isinstance(value, kind) or isinstance(value, bool) and kind is not bool:
            raise SettingsError(f"{source}: tracking.{name} must be {kind.__name__}, got {value!r}")
        return value

    enabled = field("enabled", bool, False)
    uri = field("uri", str, None)
    settings = TrackingSettings(
        enabled=enabled,
        uri=uri,
        experiment=field("experiment", str, DEFAULT_EXPERIMENT),
        alias=field("alias", str, DEFAULT_ALIAS),
        credentials=_path(field("credentials", str, None)),
        ca_bundle=_path(field("ca_bundle", str, None)),
        state_dir=Path(field("state_dir", str, _default_state_dir(config))),
        request_timeout_s=float(field("request_timeout_s", (int, float), 30.0)),
        max_retry_wait_s=float(field("max_retry_wait_s", (int, float), 300.0)),
        registry=field("registry", bool, True),
    )
    if enabled:
        check(settings, source)
    return settings


def check(settings: TrackingSettings, source: str = "config/config.yaml") -> None:
    if not settings.uri:
        raise SettingsError(f"{source}: tracking.uri is required when tracking.enabled is true")
    parts = urlsplit(settings.uri)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise SettingsError(
            f"{source}: tracking.uri must be an http(s) URL of a tracking server, got "
            f"{settings.uri!r}"
        )
    if parts.username or parts.password:
        raise SettingsError(
            f"{source}: tracking.uri must not carry credentials; put the token in the file "
            "named by tracking.credentials"
        )
    if settings.credentials is not None and parts.scheme == "http":
        if not origins.is_loopback(origins.of_url(settings.uri)):
            raise SettingsError(
                f"{source}: tracking.uri {settings.uri!r} is plain http to a host that is not "
                "loopback: a token would travel in the clear; use https"
            )
    if settings.ca_bundle is not None and not settings.ca_bundle.is_file():
        raise SettingsError(f"{source}: tracking.ca_bundle {settings.ca_bundle}: no such file")
    for name in ("experiment", "alias"):
        if not getattr(settings, name).strip():
            raise SettingsError(f"{source}: tracking.{name} must not be empty")
    for name in ("request_timeout_s", "max_retry_wait_s"):
        value = getattr(settings, name)
        if not (math.isfinite(value) and value > 0):
            raise SettingsError(f"{source}: tracking.{name} must be > 0, got {value!r}")


def _path(value: str | None) -> Path | None:
    return None if value is None else Path(value).expanduser()


def _default_state_dir(config: Mapping[str, Any] | None) -> str:
    work_dir = (config or {}).get("work_dir") or "work"
    return f"{work_dir}/tracking"


def load(config_path: Path) -> TrackingSettings:
    """The settings of a workflow config file (defaults when it has no ``tracking``)."""
    import yaml

    if not Path(config_path).is_file():
        return TrackingSettings()
    try:
        document = yaml.safe_load(Path(config_path).read_text(encoding="utf-8")) or {}
    except yaml.YAMLError as exc:
        raise SettingsError(f"{config_path}: not valid YAML ({exc})") from None
    if not isinstance(document, Mapping):
        raise SettingsError(f"{config_path}: expected a mapping at the top level")
    return from_config(document, str(config_path))
