"""Hooks after the store moved: a mirror (the MLflow model registry) follows the store.

The store stays the source of truth. A mirror is told after a publication and after the
pointer moved (outside the store's lock, so a slow server never holds the store); its
failure never undoes or fails the store's operation: it comes back as a warning, and
``minifield store verify`` reports where the mirror disagrees with the store.
"""

from __future__ import annotations

from typing import Any, Protocol


class Mirror(Protocol):
    def published(self, store: Any, content_id: str) -> dict: ...

    def moved(self, store: Any, pointer: dict) -> dict: ...

    def disagreements(self, store: Any, content_id: str) -> list[str]: ...


def notify(mirror: Mirror | None, hook: str, *args: Any) -> dict | None:
    """Call ``mirror.<hook>(*args)``; returns its report, or ``{"error": ...}``, never raises."""
    if mirror is None:
        return None
    try:
        return {"ok": True, **(getattr(mirror, hook)(*args) or {})}
    except Exception as exc:  # the store's operation stands; the mirror is repaired later
        return {"ok": False, "error": f"{type(exc).__name__}: {' '.join(str(exc).split())}"}
