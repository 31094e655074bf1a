"""What the store raises; the ``minifield store`` exit code follows the class."""

from __future__ import annotations


class StoreError(Exception):
    """A request the store cannot carry out (bad input, unknown id); exit 2."""


class Refused(StoreError):
    """Publication or activation refused; ``reasons`` names every failed check; exit 1.
    ``reevaluation``: what the gate's re-evaluation measured, where it ran (else None)."""

    def __init__(self, content_id: str | None, reasons: list[str], reevaluation=None):
        self.content_id = content_id
        self.reasons = reasons
        self.reevaluation = reevaluation
        what = f"refused {content_id}" if content_id else "refused"
        super().__init__(f"{what}: " + "; ".join(reasons) if reasons else what)


class LockTimeout(StoreError):
    """Another writer holds the store lock for longer than the timeout; exit 3."""
