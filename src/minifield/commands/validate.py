"""``minifield validate RECIPE [--input-root DIR]``: validate a recipe and print its digests;
with an input root, also verify its pinned inputs, read its harness task files (what the
pipeline's hash_inputs stage refuses before any training) and read its data files as the
prepare stage does, for text the tokenizer cannot spell (refused, or counted where the recipe
allows it: :mod:`minifield.data.unknown_text`)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from . import load_recipe


def run(args) -> int:
    from .. import own_recipe

    recipe = load_recipe(args.recipe)
    if recipe is None:
        return 2
    checked = {}
    if args.input_root is not None:
        from ..data.tokenizer import TokenizerError
        from ..harness import tasks as harness_tasks
        from ..inputs import pinned

        # bad rows, text the tokenizer cannot spell, a base model that cannot encode them:
        # InputErrors as the pinned files' own problems
        try:
            pinned.verify(recipe.data, args.input_root)
            harness_tasks.resolve_pinned(recipe.data, args.input_root)
            files = pinned.files_by_name(recipe.data, args.input_root)
            unknown = recipe.strategy.unknown_tokens(recipe.data, files)
        except (pinned.InputError, harness_tasks.HarnessTaskError, TokenizerError) as exc:
            print(f"minifield validate: {exc}", file=sys.stderr)
            return 2
        try:
            own_recipe.check_reward_columns(
                recipe.data,
                pinned.files_by_name(recipe.data, args.input_root),
                "the prepare stage refuses a prompt row without it",
            )
        except own_recipe.OwnRecipeError as exc:
            print(f"minifield validate: {exc}", file=sys.stderr)
            return 2
        if unknown:  # only a recipe that allows them has counts (the others are refused)
            checked["unknown_tokens"] = unknown
    print(
        json.dumps(
            {
                "valid": True,
                # the 16 characters results/computations/<cdigest>/ and results/examples/
                # <edigest>/ are named by; the full digests below are those the files record
                "cdigest": recipe.computation_digest[:16],
                "edigest": recipe.examples_digest[:16],
                "computation_digest": recipe.computation_digest,
                "examples_digest": recipe.examples_digest,
                **checked,
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
        help="also verify the pinned inputs under this root, read the harness task files and "
        "read the data files as prepare does (text the tokenizer cannot spell is refused)",
    )
    parser.set_defaults(func=run)
