"""How often an update's event carries the complete-state hash (no JAX: the worker checks
the setting before starting anything)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class HashCadence:
    """Which updates carry the complete-state hash in their ``update`` event.

    ``every=K`` (K ≥ 1): updates K, 2K, 3K, … (1: every update); ``every=None``: none (the
    checkpoints' manifests carry it). Hashing copies the whole state to the host, so a
    large run hashes rarely; a recovery proof hashes every update it compares.
    """

    every: int | None

    CHECKPOINT = "checkpoint"

    @classmethod
    def parse(cls, value: int | str | bool | None) -> HashCadence:
        """``1``/``K``/``"checkpoint"`` (also ``True`` = 1 and ``False``/None = checkpoint)."""
        if value is None or value is False or value == cls.CHECKPOINT:
            return cls(None)
        if value is True:
            return cls(1)
        every = int(value) if isinstance(value, str) and value.isdigit() else value
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(
                f"state hash cadence {value!r}: expected a positive integer K (every K "
                f"updates) or {cls.CHECKPOINT!r}"
            )
        return cls(every)

    def due(self, step: int) -> bool:
        return self.every is not None and step % self.every == 0

    def describe(self) -> int | str:
        return self.every if self.every is not None else self.CHECKPOINT
