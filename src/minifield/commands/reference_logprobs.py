"""``minifield reference-logprobs --recipe R --input-root D --out DIR``: the reference model's
per-answer log-probabilities of a preference recipe's pairs, computed once into ``DIR``
(:mod:`minifield.strategies.preference.reference`). Prints what it wrote (the digest that
addresses it, the pair counts, the data file's sha256). A bad recipe, a missing or altered
input, or a bad pair row is refused with one line naming it (exit 2), nothing written."""

from __future__ import annotations

import json
import sys
from pathlib import Path


def run(args) -> int:
    from ..inputs.pinned import InputError
    from ..pipeline import reference_logprobs
    from ..recipe import RecipeError
    from ..training.data_parallel import DeviceCountError

    try:
        record = reference_logprobs.compute(args.recipe, args.input_root, args.out)
    except RecipeError as exc:
        problems = "; ".join(f"{e['path'] or '/'}: {e['message']}" for e in exc.errors)
        print(f"minifield reference-logprobs: {exc.source}: {problems}", file=sys.stderr)
        return 2
    except (InputError, OSError) as exc:
        print(f"minifield reference-logprobs: {exc}", file=sys.stderr)
        return 2
    except DeviceCountError as exc:  # the recipe's mesh is not here: not a bad input
        print(f"minifield reference-logprobs: {exc}", file=sys.stderr)
        return 1
    print(json.dumps({k: record[k] for k in ("digest", "splits", "files")}, indent=2))
    return 0


def register(sub) -> None:
    parser = sub.add_parser(
        "reference-logprobs",
        help="compute a preference recipe's reference log-probabilities (DPO/IPO) once",
    )
    parser.add_argument("--recipe", type=Path, required=True, help="the preference recipe")
    parser.add_argument(
        "--input-root", type=Path, required=True, help="where the recipe's inputs are"
    )
    parser.add_argument(
        "--out",
        type=Path,
        required=True,
        help="the directory reference.safetensors and reference.json are written into",
    )
    parser.set_defaults(func=run)
