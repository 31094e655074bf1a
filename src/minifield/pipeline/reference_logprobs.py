"""The reference log-probabilities stage: a preference recipe (a file, as the rules and
``minifield reference-logprobs`` have it) whose reference input is not pinned yet, since
this stage computes it.

The recipe is validated whole, its reference input standing in as a placeholder
(:func:`minifield.strategies.preference.reference.pending`), then the strategy's
:func:`~minifield.strategies.preference.reference.compute` and
:func:`~minifield.strategies.preference.reference.reference_digest` take it. Validation
lives here, above the strategies (the import layers: a strategy never imports the recipe).
"""

from __future__ import annotations

from pathlib import Path

from .. import recipe as recipes
from ..strategies import preference


def validated(recipe_path: Path) -> recipes.Recipe:
    """The recipe file validated, its reference input allowed to be unpinned (a
    :class:`~minifield.recipe.RecipeError` names every other problem)."""
    document = recipes.read_document(recipe_path)
    if isinstance(document, dict):
        document = preference.reference.pending(document)
    return recipes.validate(document, str(recipe_path))


def digest(recipe_path: Path, input_root: Path) -> str:
    """The address of the recipe's reference directory."""
    return preference.reference.reference_digest(validated(recipe_path), input_root)


def compute(recipe_path: Path, input_root: Path, out_dir: Path) -> dict:
    """Compute the recipe's reference log-probabilities into ``out_dir``; the record."""
    return preference.reference.compute(validated(recipe_path), input_root, out_dir)
