"""``minifield validate RECIPE``: validate a recipe and print its digests."""

from __future__ import annotations

import json
import sys
from pathlib import Path


def run(args) -> int:
    from .. import recipe as recipes

    try:
        recipe = recipes.load(args.recipe)
    except recipes.RecipeError as exc:
        print(str(exc), file=sys.stderr)
        return 2
    print(
        json.dumps(
            {
                "valid": True,
                "computation_digest": recipe.computation_digest,
                "examples_digest": recipe.examples_digest,
            },
            indent=2,
        )
    )
    return 0


def register(sub) -> None:
    parser = sub.add_parser("validate", help="validate a recipe and print its digests")
    parser.add_argument("recipe", type=Path)
    parser.set_defaults(func=run)
