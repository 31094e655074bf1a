"""Origins (scheme://host:port) of remote inputs and the policy deciding which may be fetched.

An origin is always written in one normal form — lower-case scheme and host,
explicit port (443 for https, 80 for http), IPv6 hosts in brackets — so that
``https://Assets.example`` and ``https://assets.example:443`` are the same
entry in the allow-list, the credentials file and the redirect check.
"""

from __future__ import annotations

import ipaddress
from urllib.parse import urlsplit

DEFAULT_PORTS = {"https": 443, "http": 80}


class OriginError(Exception):
    """A URL or origin that cannot be used: malformed, not allowed, or not secure enough."""


def _split(text: str, what: str):
    try:
        parts = urlsplit(text)
        port = parts.port  # raises ValueError for a non-numeric or out-of-range port
    except ValueError as exc:
        raise OriginError(f"{what} {text!r} is not a valid URL ({exc})") from None
    scheme = parts.scheme.lower()
    if scheme not in DEFAULT_PORTS:
        raise OriginError(f"{what} {text!r}: scheme must be https (or http for loopback testing)")
    if not parts.hostname:
        raise OriginError(f"{what} {text!r} has no host")
    if parts.username is not None or parts.password is not None:
        # Credentials in a URL end up in recipes, results and logs; they belong in the
        # owner-only credentials file instead.
        raise OriginError(
            f"{what} {_without_userinfo(parts)!r} carries user credentials in the URL; "
            "put a bearer token in the credentials file instead"
        )
    return parts, scheme, port if port is not None else DEFAULT_PORTS[scheme]


def _without_userinfo(parts) -> str:
    host = parts.netloc.rsplit("@", 1)[-1]
    return f"{parts.scheme}://{host}{parts.path}"


def _host_text(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def of_url(url: str) -> str:
    """The normal-form origin of a URL, e.g. ``https://assets.example:443``."""
    _, scheme, port = _split(url, "URL")
    host = urlsplit(url).hostname.lower()
    return f"{scheme}://{_host_text(host)}:{port}"


def normalise(origin: str) -> str:
    """Normal form of an origin written by a user; refuses paths, queries and fragments."""
    parts, scheme, port = _split(origin.strip(), "origin")
    if parts.path not in ("", "/") or parts.query or parts.fragment:
        raise OriginError(
            f"origin {origin!r} must be scheme://host[:port] only, without a path or query"
        )
    return f"{scheme}://{_host_text(parts.hostname.lower())}:{port}"


def host_of(origin: str) -> str:
    return urlsplit(origin).hostname


def is_loopback(origin: str) -> bool:
    """True for ``localhost``, 127.0.0.0/8 and ::1 — traffic that never leaves this machine."""
    host = host_of(origin)
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class Policy:
    """Which origins may be fetched: listed ones, over https (http only on allowed loopback)."""

    def __init__(self, allowed: list[str], *, allow_insecure_loopback: bool = False):
        self.allow_insecure_loopback = allow_insecure_loopback
        normal = []
        for entry in allowed:
            origin = normalise(entry)
            self._check_scheme(origin, f"allowed origin {entry!r}")
            normal.append(origin)
        self.allowed = tuple(dict.fromkeys(normal))

    def _check_scheme(self, origin: str, what: str) -> None:
        if origin.startswith("https://"):
            return
        if not is_loopback(origin):
            raise OriginError(
                f"{what} ({origin}) uses plain http: only https is fetched, except loopback "
                "origins (127.0.0.1, ::1, localhost) explicitly allowed for testing"
            )
        if not self.allow_insecure_loopback:
            raise OriginError(
                f"{what} ({origin}) uses plain http on loopback; allow it explicitly with "
                "allow_insecure_loopback: true (--allow-insecure-loopback), for testing only"
            )

    def check(self, url: str) -> str:
        """The URL's origin if it may be fetched; OriginError with the reason otherwise."""
        origin = of_url(url)
        if origin not in self.allowed:
            listed = ", ".join(self.allowed) or "none"
            raise OriginError(
                f"origin {origin} of {url} is not an allowed origin (allowed: {listed}); "
                "add it to remote_inputs.allowed_origins (--allow-origin) if it is trusted"
            )
        self._check_scheme(origin, f"origin of {url}")
        return origin
