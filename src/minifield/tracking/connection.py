"""The MLflow client, its credentials, and the retry policy of every call.

- The token comes from the credentials file (:mod:`minifield.inputs.credentials`: owner-only, mode
  0600/0400, ``{"<origin>": {"bearer_token": "..."}}``) for exactly the tracking server's
  origin. The MLflow client reads it from ``MLFLOW_TRACKING_TOKEN`` at request time, so it
  is put there only for the duration of each call (:meth:`Connection.call`) and removed
  afterwards: it is never written anywhere, never handed to a child process, and every
  message shown is redacted.
- The client's own retries are switched off; :meth:`Connection.call` retries connection
  errors, HTTP 429 and 5xx with exponential backoff (capped), and raises
  :class:`DeliveryRefused` at once for any other 4xx: a request the server refuses will not
  be accepted by sending it again.
"""

from __future__ import annotations

import contextlib
import os
import random
import re
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from ..inputs import credentials as credential_files
from .settings import TrackingSettings

T = TypeVar("T")

_ENV_LOCK = threading.Lock()
_CLIENT_ENV = {
    # our retry loop decides; the client's own would wait minutes inside one call
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0",
    # the client prints run links on our stdout, where the commands print their records
    "MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT": "true",
    # a pipeline does not report its usage to anyone but the configured server (and a
    # background sender thread must not hold locks a forked process inherits)
    "MLFLOW_DISABLE_TELEMETRY": "true",
}
_STATUS_IN_MESSAGE = re.compile(r"error code (\d{3})")


class TrackingError(Exception):
    """Delivery could not happen; the message never contains a token."""


class DeliveryRefused(TrackingError):
    """The server answered with a client error (4xx other than 429): retrying cannot help."""

    def __init__(self, message: str, status: int | None):
        super().__init__(message)
        self.status = status


class ServerUnavailable(TrackingError):
    """Connection errors or 5xx for longer than the retry budget."""


class Connection:
    """One tracking server: an ``MlflowClient`` and the calls made through it."""

    def __init__(self, settings: TrackingSettings, *, sleep: Callable[[float], None] = time.sleep):
        self.settings = settings
        self._credentials = credential_files.load(settings.credentials)
        self._token = self._credentials.token_for(settings.origin) if settings.credentials else None
        if settings.credentials is not None and self._token is None:
            raise TrackingError(
                f"credentials file {settings.credentials} has no token for the tracking "
                f"server's origin {settings.origin}"
            )
        self._sleep = sleep
        self._stop: threading.Event | None = None
        os.environ.update(_CLIENT_ENV)
        os.environ["MLFLOW_HTTP_REQUEST_TIMEOUT"] = str(int(max(1, settings.request_timeout_s)))
        from mlflow import MlflowClient

        self.client = MlflowClient(tracking_uri=settings.uri, registry_uri=settings.uri)

    def stop_retrying_on(self, event: threading.Event) -> None:
        """Give up waiting (raise :class:`ServerUnavailable`) as soon as ``event`` is set."""
        self._stop = event

    def redact(self, text: str) -> str:
        return self._credentials.redact(text)

    @contextlib.contextmanager
    def _credentials_in_env(self) -> Iterator[None]:
        if self._token is None and self.settings.ca_bundle is None:
            yield
            return
        names = {
            "MLFLOW_TRACKING_TOKEN": self._token,
            "MLFLOW_TRACKING_SERVER_CERT_PATH": (
                str(self.settings.ca_bundle) if self.settings.ca_bundle else None
            ),
        }
        with _ENV_LOCK:
            saved = {name: os.environ.get(name) for name in names}
            try:
                for name, value in names.items():
                    if value is not None:
                        os.environ[name] = value
                yield
            finally:
                for name, value in saved.items():
                    if value is None:
                        os.environ.pop(name, None)
                    else:
                        os.environ[name] = value

    def call(self, what: str, function: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """``function(*args, **kwargs)`` with the credentials, retried while the server is
        unreachable or failing (5xx/429), for at most ``max_retry_wait_s`` seconds of waiting."""
        waited, delay = 0.0, 0.5
        while True:
            try:
                with self._credentials_in_env():
                    return function(*args, **kwargs)
            except Exception as exc:  # the client raises MlflowException and requests' errors
                status, transient = classify(exc)
                message = self.redact(" ".join(str(exc).split()))[:600]
                if not transient:
                    raise DeliveryRefused(
                        f"tracking server {self.settings.uri} refused {what} (HTTP {status}): "
                        f"{message}",
                        status,
                    ) from None
                stopping = self._stop is not None and self._stop.is_set()
                if stopping or waited >= self.settings.max_retry_wait_s:
                    raise ServerUnavailable(
                        f"tracking server {self.settings.uri} unavailable for {what} "
                        f"(waited {waited:.0f} s): {message}"
                    ) from None
                pause = min(delay, 30.0) * (0.5 + random.random() / 2)
                if self._stop is not None:
                    self._stop.wait(pause)
                else:
                    self._sleep(pause)
                waited += pause
                delay *= 2


def classify(exc: BaseException) -> tuple[int | None, bool]:
    """(HTTP status if known, whether retrying can help) for an error of a client call."""
    from mlflow.exceptions import MlflowException, RestException

    if isinstance(exc, RestException):  # the server answered with an MLflow error document
        status = exc.get_http_status_code()
        return status, status == 429 or status >= 500
    if isinstance(exc, MlflowException):
        found = _STATUS_IN_MESSAGE.search(str(exc))
        if found:  # an HTTP error without an MLflow body (a proxy's 502, a 404 page ...)
            status = int(found.group(1))
            return status, status == 429 or status >= 500
        return None, True  # "API request ... failed with exception": no answer at all
    if isinstance(exc, OSError):
        return None, True
    import requests

    if isinstance(exc, requests.RequestException):
        return None, True
    return None, False
