"""What every model config has (:class:`ArchitectureConfig`): its checks, head width, compute
dtype and dict form. Kept apart from :mod:`.primitives` and free of JAX, so that reading a
recipe's model section or an HF ``config.json`` (the pipeline's prepare, validate and recipe
commands) does not pay JAX's import, about 1 CPU-s per process."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

COMPUTE_DTYPES = ("bfloat16", "float32")


class ArchitectureConfig:
    """What every model config (a frozen dataclass deriving from this) has: its checks, its
    head width and compute dtype, and its ``to_dict`` / ``from_dict`` form.

    A subclass names its positive-integer and true-or-false fields and adds the checks of its
    own architecture (:meth:`architecture_errors`); errors are reported together, named by
    their recipe field, in one ``ValueError``.
    """

    architecture: ClassVar[str]
    #: fields that must be positive integers, and fields that must be true or false
    INTEGER_FIELDS: ClassVar[tuple[str, ...]]
    FLAG_FIELDS: ClassVar[tuple[str, ...]]

    def __post_init__(self):
        errors = []
        for name in self.INTEGER_FIELDS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                errors.append(f"model.{name}: expected a positive integer, got {value!r}")
        errors += self.architecture_errors(sizes_valid=not errors)
        for name in self.FLAG_FIELDS:
            if not isinstance(getattr(self, name), bool):
                errors.append(f"model.{name}: expected true or false, got {getattr(self, name)!r}")
        if self.compute_dtype not in COMPUTE_DTYPES:
            errors.append(
                f"model.compute_dtype: expected one of {COMPUTE_DTYPES}, got {self.compute_dtype!r}"
            )
        if errors:
            raise ValueError("; ".join(errors))

    def architecture_errors(self, sizes_valid: bool) -> list[str]:
        """The architecture's own checks (``sizes_valid``: every integer field is valid)."""
        return []

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def dtype(self):
        import jax.numpy as jnp  # here: a config is read without JAX (a pipeline's prepare)

        return jnp.bfloat16 if self.compute_dtype == "bfloat16" else jnp.float32

    @classmethod
    def from_dict(cls, d: dict):
        """Build from :meth:`to_dict`'s form; unknown or missing keys are an error (named)."""
        d = {k: v for k, v in d.items() if not (k == "architecture" and v == cls.architecture)}
        fields = dataclasses.fields(cls)
        known = {f.name for f in fields}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"model: unknown keys {unknown}; expected a subset of {sorted(known)}")
        missing = sorted(
            f.name for f in fields if f.default is dataclasses.MISSING and f.name not in d
        )
        if missing:
            raise ValueError(f"model: missing required keys {missing}")
        return cls(**d)

    def to_dict(self) -> dict:
        """The architecture's fields (not how it computes: ``execution`` is left out)."""
        out = dataclasses.asdict(self)
        del out["execution"]
        return out
