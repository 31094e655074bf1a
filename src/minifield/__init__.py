"""minifield: a reproducible training pipeline on Snakemake and JAX.

The Python API (see :mod:`minifield.api` and the README's "Python API"):

    minifield.validate(recipe) -> Validation    # a path or a dict; never imports JAX
    minifield.run(recipe, input_root=..., output_root=...) -> RunResult
    minifield.load_model(path) -> LoadedModel        # an HF directory or an export

Importing ``minifield`` is cheap: the API module is loaded on first use, and
JAX only when ``run`` trains or ``load_model`` loads.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

__version__ = "0.1.0"
__all__ = ["RunResult", "Validation", "__version__", "load_model", "run", "validate"]

if TYPE_CHECKING:
    from .api import RunResult, Validation, load_model, run, validate


def __getattr__(name: str):
    # Loaded on first use: every process importing a minifield module (the Snakefile, the
    # supervisor, each command) would otherwise pay for jsonschema, yaml and numpy.
    if name in ("RunResult", "Validation", "load_model", "run", "validate"):
        from . import api

        return getattr(api, name)
    raise AttributeError(f"module 'minifield' has no attribute {name!r}")
