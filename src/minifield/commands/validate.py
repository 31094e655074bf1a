"""``minifield validate RECIPE [--input-root DIR]``: validate a recipe and print its digests;
with an input root, also verify its pinned inputs and read its harness task files (what the
pipeline's hash_inputs stage refuses before any training)."""

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
    if args.input_root is not None:
        from ..harness import tasks as harness_tasks
        from ..inputs import pinned

        try:
            pinned.verify(recipe.data, args.input_root)
            harness_tasks.resolve_pinned(recipe.data, args.input_root)
        except (pinned.InputError, harness_tasks.HarnessTaskError) as exc:
            print(f"minifield validate: {exc}", file=sys.stderr)
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
    parser.add_argument(
        "--input-root",
        type=Path,
        help="also verify the pinned inputs under this root and read the harness task files",
    )
    parser.set_defaults(func=run)
