"""Registry of the computations this package accepts."""

from __future__ import annotations

from .base import Program, Strategy
from .linear_momentum import LinearMomentum
from .packed_sft import PackedSFT
from .preference.strategy import Preference
from .two_stage import TwoStage

_REGISTRY: dict[tuple[str, str], Strategy] = {}


def register(strategy: Strategy) -> None:
    _REGISTRY[(strategy.name, strategy.version)] = strategy


def get(name: str, version: str) -> Strategy | None:
    return _REGISTRY.get((name, version))


def available() -> list[Strategy]:
    return [_REGISTRY[key] for key in sorted(_REGISTRY)]


register(LinearMomentum())
register(PackedSFT())
register(Preference())
register(TwoStage())

__all__ = ["Program", "Strategy", "available", "get", "register"]
