"""The ``linear-momentum`` strategy: ``strategy`` (schema, checks, data, acceptance; no JAX),
``program`` (the compiled update), ``teacher`` (y = 2x + 1: examples and held-out error)."""

from .strategy import LinearMomentum

__all__ = ["LinearMomentum"]
