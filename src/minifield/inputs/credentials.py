"""Bearer tokens per origin, read from an owner-only JSON file and never shown.

The file maps an origin to its token::

    {"https://assets.example:443": {"bearer_token": "..."}}

It is refused unless only its owner can read it (mode 0600 or 0400), because a
token readable by other users of a shared cluster is a leaked token. Tokens are
held by :class:`Credentials`, whose text forms never contain them, and
:meth:`Credentials.redact` removes them from any message before it is shown.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

from . import origins


class CredentialsError(Exception):
    """A credentials file that cannot be used; the message never contains a token."""


class Credentials:
    """Tokens keyed by normal-form origin; ``repr``/``str`` show origins only."""

    def __init__(self, tokens: dict[str, str] | None = None, source: str | None = None):
        self._tokens = dict(tokens or {})
        self.source = source

    def token_for(self, origin: str) -> str | None:
        """The token of exactly this origin (never of another one)."""
        return self._tokens.get(origin)

    def has(self, origin: str) -> bool:
        return origin in self._tokens

    def redact(self, text: str) -> str:
        for token in self._tokens.values():
            text = text.replace(token, "[redacted]")
        return text

    def __repr__(self) -> str:
        return f"Credentials(source={self.source!r}, origins={sorted(self._tokens)})"

    __str__ = __repr__


def load(path: str | Path | None) -> Credentials:
    """Read and check a credentials file; ``None`` means no credentials at all."""
    if path is None:
        return Credentials()
    path = Path(path)
    try:
        # O_NOFOLLOW: the mode checked must be the mode of the file actually read.
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except OSError as exc:
        raise CredentialsError(
            f"credentials file {path}: cannot open ({exc.strerror}); it must be a regular "
            "file (not a symbolic link) readable by its owner only"
        ) from None
    with os.fdopen(fd, "rb") as handle:
        info = os.fstat(handle.fileno())
        if not stat.S_ISREG(info.st_mode):
            raise CredentialsError(f"credentials file {path}: not a regular file")
        if info.st_uid != os.getuid():
            raise CredentialsError(
                f"credentials file {path} is owned by uid {info.st_uid}, not by the user "
                f"running minifield (uid {os.getuid()}); refusing to use it"
            )
        mode = stat.S_IMODE(info.st_mode)
        if mode & 0o077:
            raise CredentialsError(
                f"credentials file {path} has mode {mode:04o}: group or other users can "
                f"access it, so its tokens must be considered exposed; it must be owner-only "
                f"(run: chmod 600 {path})"
            )
        raw = handle.read()
    return parse(raw, str(path))


def parse(raw: bytes, source: str) -> Credentials:
    try:
        document = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        # The decoder's message may quote the file's text, so only its position is shown.
        where = f" at line {exc.lineno} column {exc.colno}" if hasattr(exc, "lineno") else ""
        raise CredentialsError(f"credentials file {source}: not valid UTF-8 JSON{where}") from None
    if not isinstance(document, dict):
        raise CredentialsError(
            f"credentials file {source}: expected a JSON object "
            '{"<scheme://host:port>": {"bearer_token": "..."}}'
        )
    tokens: dict[str, str] = {}
    for key, entry in document.items():
        try:
            origin = origins.normalise(key)
        except origins.OriginError as exc:
            raise CredentialsError(f"credentials file {source}: key {key!r}: {exc}") from None
        if origin in tokens:
            raise CredentialsError(
                f"credentials file {source}: origin {origin} is listed twice (as {key!r})"
            )
        if not isinstance(entry, dict) or set(entry) != {"bearer_token"}:
            raise CredentialsError(
                f"credentials file {source}: entry {key!r} must be an object with exactly "
                'one field, "bearer_token"'
            )
        token = entry["bearer_token"]
        # Printable ASCII only: anything else is refused by HTTP libraries with messages
        # that may quote the header value.
        if not isinstance(token, str) or not token or not all("!" <= c <= "~" for c in token):
            raise CredentialsError(
                f"credentials file {source}: entry {key!r}: bearer_token must be a non-empty "
                "string of printable ASCII characters without whitespace"
            )
        tokens[origin] = token
    return Credentials(tokens, source)
