"""Remote inputs: download pinned files into a content-addressed cache and place them by name.

A remote input is ``{"name", "url", "sha256", "size"}``. Its blob lives at
``<cache>/sha256/<sha256>``. A download streams into a temporary file under
``<cache>/tmp/`` while counting bytes and hashing; only a body of exactly the
pinned size with exactly the pinned sha256 is renamed into ``sha256/``, so a
partial or wrong download never lands. A blob already in the cache is
re-verified and used without touching the network.

Security rules (see docs/remote-inputs.md): only allowed origins, https except
explicitly allowed loopback origins, redirects followed by hand and only within
the same origin, a bearer token sent only to its own origin, and no token in
any message, record or log.

Retries: connection failures, timeouts, bodies that end early and HTTP 408/429/5xx
are transient and retried (bounded, exponential backoff). A refused origin or
redirect, a TLS verification failure, HTTP 401/403/404 and other 4xx, a size
announced by the server that differs from the pin, a body longer than the pin
and a full-size body with the wrong sha256 are permanent: the same request
would get the same answer, so they fail at once.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, TextIO
from urllib.parse import urljoin

from .. import atomic
from ..digest import sha256_file
from . import credentials, origins
from .progress import DownloadProgress

if TYPE_CHECKING:
    import requests

# ``requests`` is imported where a download happens, not with this module: its import is slow
# (it loads ``chardet``, whose 6.x models are slow to import; the cost: docs/development.md,
# "Start-up cost"), and every pipeline job that validates, hashes or prepares inputs imports
# this module, usually with no remote input to fetch.

_CHUNK = 1 << 20
REDIRECT_CODES = (301, 302, 303, 307, 308)
TRANSIENT_CODES = (408, 429)


class FetchError(Exception):
    """A remote input that could not be fetched and verified; ``transient`` says if retrying may help."""

    def __init__(self, message: str, *, transient: bool = False):
        super().__init__(message)
        self.transient = transient


@dataclass
class Settings:
    allowed_origins: list[str]
    cache_dir: Path
    credentials: credentials.Credentials = field(default_factory=credentials.Credentials)
    ca_bundle: Path | None = None
    allow_insecure_loopback: bool = False
    max_attempts: int = 4
    backoff_seconds: float = 0.5
    timeout_seconds: float = 60.0
    max_redirects: int = 5
    progress_min_bytes: int = 8 << 20

    def __post_init__(self):
        # Raises OriginError for malformed, plain-http or not-explicitly-allowed loopback entries.
        self.policy = origins.Policy(
            self.allowed_origins, allow_insecure_loopback=self.allow_insecure_loopback
        )
        if self.max_attempts < 1:
            raise ValueError("max_attempts must be at least 1")
        if self.ca_bundle is not None and not Path(self.ca_bundle).is_file():
            raise FetchError(f"CA bundle {self.ca_bundle} does not exist")

    @classmethod
    def from_config(cls, section: dict, work_dir: str | Path) -> Settings:
        """Settings from the config's ``remote_inputs`` section (defaults filled by its schema)."""

        def path(key: str) -> Path | None:
            return Path(section[key]).expanduser() if section.get(key) else None

        return cls(
            allowed_origins=list(section.get("allowed_origins", [])),
            cache_dir=path("cache_dir") or Path(work_dir) / "cache",
            credentials=credentials.load(path("credentials_file")),
            ca_bundle=path("ca_bundle"),
            allow_insecure_loopback=bool(section.get("allow_insecure_loopback", False)),
            max_attempts=int(section.get("max_attempts", 4)),
            backoff_seconds=float(section.get("backoff_seconds", 0.5)),
            timeout_seconds=float(section.get("timeout_seconds", 60.0)),
        )


def blob_path(cache_dir: Path, sha256: str) -> Path:
    return Path(cache_dir) / "sha256" / sha256


def remote_items(recipe: dict) -> list[dict]:
    return [item for item in recipe.get("inputs", []) if "url" in item]


def _session(settings: Settings) -> requests.Session:
    import requests

    session = requests.Session()
    # No ~/.netrc credentials, no proxy or CA settings from the environment: what is
    # sent where is decided by the settings alone.
    session.trust_env = False
    session.verify = str(settings.ca_bundle) if settings.ca_bundle else True
    return session


def _status_error(origin: str, url: str, response: requests.Response, settings) -> FetchError:
    code = response.status_code
    text = f"{origin} answered HTTP {code} {response.reason or ''}".rstrip() + f" for {url}"
    if code == 401 or code == 403:
        if settings.credentials.has(origin):
            hint = "the bearer token configured for this origin was not accepted"
        else:
            source = settings.credentials.source or "no credentials file given"
            hint = f"no bearer token is configured for this origin ({source})"
        return FetchError(f"{text}: {hint}")
    if code == 404:
        return FetchError(f"{text}: not found (check the URL pinned in the recipe)")
    transient = code in TRANSIENT_CODES or code >= 500
    return FetchError(text, transient=transient)


def _get(session: requests.Session, url: str, origin: str, settings: Settings):
    """GET with redirects followed by hand: same origin only, at most ``max_redirects``."""
    import requests

    current = url
    for _ in range(settings.max_redirects + 1):
        headers = {"Accept-Encoding": "identity"}
        token = settings.credentials.token_for(origins.of_url(current))
        if token is not None:
            headers["Authorization"] = f"Bearer {token}"
        try:
            response = session.get(
                current,
                headers=headers,
                stream=True,
                allow_redirects=False,
                timeout=settings.timeout_seconds,
            )
        except requests.exceptions.SSLError as exc:
            raise FetchError(
                f"TLS verification failed for {origin} ({type(exc).__name__}); "
                "give the server's CA with ca_bundle (--ca-bundle) if it is trusted"
            ) from None
        except (requests.exceptions.ConnectionError, requests.exceptions.Timeout) as exc:
            raise FetchError(
                f"connection to {origin} failed ({type(exc).__name__}: {exc})", transient=True
            ) from None
        except requests.exceptions.RequestException as exc:
            raise FetchError(f"request to {origin} failed ({type(exc).__name__}: {exc})") from None
        if response.status_code not in REDIRECT_CODES:
            return response
        location = response.headers.get("Location")
        response.close()
        if not location:
            raise FetchError(f"{origin} answered a redirect without a Location for {current}")
        target = urljoin(current, location)
        try:
            target_origin = origins.of_url(target)
        except origins.OriginError as exc:
            raise FetchError(f"redirect from {current} refused: {exc}") from None
        if target_origin != origin:
            # Only the origin is named: the refused location may carry a signed query.
            raise FetchError(
                f"redirect from {current} to another origin ({target_origin}) refused: "
                f"remote inputs are fetched from their pinned origin {origin} only"
            )
        current = target
    raise FetchError(f"more than {settings.max_redirects} redirects starting at {url}")


def _download_once(
    session: requests.Session,
    url: str,
    origin: str,
    sha256: str,
    size: int,
    settings: Settings,
    label: str,
    stream: TextIO,
) -> None:
    import requests

    tmp_dir = Path(settings.cache_dir) / "tmp"
    tmp_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f"{sha256[:16]}.", suffix=".part", dir=tmp_dir)
    try:
        with os.fdopen(fd, "wb") as handle:
            response = _get(session, url, origin, settings)
            with response:
                if response.status_code != 200:
                    raise _status_error(origin, url, response, settings)
                announced = response.headers.get("Content-Length")
                if announced is not None and announced.strip().isdigit():
                    if int(announced) != size:
                        raise FetchError(
                            f"{url}: the server announces {int(announced)} bytes but the recipe "
                            f"pins size {size}: not the pinned file"
                        )
                digest, done = hashlib.sha256(), 0
                progress = DownloadProgress(label, size, settings.progress_min_bytes, stream)
                try:
                    for chunk in response.iter_content(_CHUNK):
                        done += len(chunk)
                        if done > size:
                            raise FetchError(
                                f"{url}: the body is longer than the pinned size {size} bytes: "
                                "not the pinned file"
                            )
                        digest.update(chunk)
                        handle.write(chunk)
                        progress.update(done)
                except (
                    requests.exceptions.ConnectionError,
                    requests.exceptions.ChunkedEncodingError,
                    requests.exceptions.Timeout,
                ) as exc:
                    raise FetchError(
                        f"{url}: transfer from {origin} broke off after {done} of {size} bytes "
                        f"({type(exc).__name__})",
                        transient=True,
                    ) from None
            if done < size:
                raise FetchError(
                    f"{url}: the transfer from {origin} ended early (connection closed after "
                    f"{done} of the pinned {size} bytes)",
                    transient=True,
                )
            progress.update(done, final=True)
            actual = digest.hexdigest()
            if actual != sha256:
                raise FetchError(
                    f"{url}: downloaded {size} bytes with sha256 {actual}, but the recipe pins "
                    f"{sha256}: not the pinned file (nothing was cached)"
                )
            handle.flush()
            os.fsync(handle.fileno())
        # Read-only: a blob is shared (hard links) and must never change in place.
        os.chmod(tmp, 0o444)
        target = blob_path(settings.cache_dir, sha256)
        target.parent.mkdir(parents=True, exist_ok=True)
        os.replace(tmp, target)
        atomic.fsync_dir(target.parent)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _cached(settings: Settings, sha256: str, size: int) -> bool:
    """True if a verified blob is in the cache; a cached blob that fails verification is removed."""
    path = blob_path(settings.cache_dir, sha256)
    if not path.is_file():
        return False
    if path.stat().st_size == size and sha256_file(path) == sha256:
        return True
    path.unlink()
    return False


def fetch_blob(
    url: str,
    sha256: str,
    size: int,
    settings: Settings,
    *,
    label: str | None = None,
    stream: TextIO | None = None,
    session: requests.Session | None = None,
) -> dict:
    """Make ``<cache>/sha256/<sha256>`` hold the pinned file; returns how it got there."""
    stream = stream or sys.stderr
    label = label or url
    started = time.monotonic()
    try:
        origin = settings.policy.check(url)
    except origins.OriginError as exc:
        raise FetchError(str(exc)) from None
    if _cached(settings, sha256, size):
        return {"source": "cache", "attempts": 0, "seconds": time.monotonic() - started}
    session = session or _session(settings)
    for attempt in range(1, settings.max_attempts + 1):
        try:
            _download_once(session, url, origin, sha256, size, settings, label, stream)
            return {
                "source": "network",
                "attempts": attempt,
                "seconds": time.monotonic() - started,
            }
        except FetchError as exc:
            message = settings.credentials.redact(str(exc))
            if not exc.transient:
                raise FetchError(message) from None
            if attempt == settings.max_attempts:
                raise FetchError(
                    f"{message} (gave up after {attempt} attempts)", transient=True
                ) from None
            delay = min(settings.backoff_seconds * 2 ** (attempt - 1), 30.0)
            print(
                f"fetch {label}: attempt {attempt} failed ({message}); retrying in {delay:.2f} s",
                file=stream,
                flush=True,
            )
            time.sleep(delay)
    raise AssertionError("unreachable")


def place(blob: Path, destination: Path) -> None:
    """Put a cached blob at ``destination`` atomically: a hard link, or a copy across filesystems."""
    destination.parent.mkdir(parents=True, exist_ok=True)
    tmp = destination.parent / f".{destination.name}.{os.getpid()}.placing"
    if tmp.exists():
        tmp.unlink()
    try:
        try:
            os.link(blob, tmp)
        except OSError:
            shutil.copyfile(blob, tmp)
        os.replace(tmp, destination)
    finally:
        if tmp.exists():
            tmp.unlink()


def fetch_inputs(
    recipe: dict, dest: Path, settings: Settings, *, stream: TextIO | None = None
) -> list[dict]:
    """Fetch every remote input of a validated recipe into ``dest/<name>``.

    Every input is attempted before failing, so one run names every problem.
    Returns one record per remote input (no tokens, no credentials path).
    """
    records, problems = [], []
    session = _session(settings)
    for item in remote_items(recipe):
        label = f"input {item['name']!r}"
        try:
            outcome = fetch_blob(
                item["url"],
                item["sha256"],
                item["size"],
                settings,
                label=label,
                stream=stream,
                session=session,
            )
        except FetchError as exc:
            problems.append(f"{label}: {exc}")
            continue
        place(blob_path(settings.cache_dir, item["sha256"]), Path(dest) / item["name"])
        records.append(
            {
                "name": item["name"],
                "url": item["url"],
                "origin": origins.of_url(item["url"]),
                "sha256": item["sha256"],
                "size": item["size"],
                "authenticated": settings.credentials.has(origins.of_url(item["url"])),
                **outcome,
            }
        )
    if problems:
        raise FetchError(settings.credentials.redact("; ".join(problems)))
    return records
