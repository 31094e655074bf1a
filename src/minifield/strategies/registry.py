"""The computations this package accepts, by (name, version).

The package's ``__init__`` registers every strategy; a strategy that runs another one (the
two-stage strategy's second stage is packed-sft) finds it here, at call time, never by
importing the other strategy's modules.
"""

from __future__ import annotations

from .base import Strategy

_REGISTRY: dict[tuple[str, str], Strategy] = {}


def register(strategy: Strategy) -> None:
    _REGISTRY[(strategy.name, strategy.version)] = strategy


def get(name: str, version: str) -> Strategy | None:
    return _REGISTRY.get((name, version))


def available() -> list[Strategy]:
    return [_REGISTRY[key] for key in sorted(_REGISTRY)]
