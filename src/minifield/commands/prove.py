"""``minifield prove RECIPE``: run the recovery proof of a recipe and write proof.json.

Exit 0 when the proof passed, 1 when it did not (the diagnosis says why), 2 on
bad usage or an invalid recipe.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def run(args) -> int:
    # imported here: loading the CLI (e.g. for `minifield supervise`) should not load JAX
    from .. import recipe as recipes
    from .. import recovery

    try:
        proof = recovery.prove(
            args.recipe,
            args.input_root,
            args.work_dir,
            args.out,
            steps=args.steps,
            fail_after_step=args.fail_after_step,
            examples_dir=args.examples,
            deadline_s=args.deadline_s,
            stall_s=args.stall_s,
            grace_s=args.grace_s,
        )
    except recipes.RecipeError as exc:
        print(str(exc), file=sys.stderr)
        return 2
    summary = {
        "passed": proof["passed"],
        "diagnosis": proof["diagnosis"],
        "checkpoint_used": proof["checkpoint_used"],
        "first_divergence": proof["first_divergence"],
        "proof": str(args.out or Path(proof["proof_dir"]) / "proof.json"),
        "seconds": round(proof["seconds"], 3),
    }
    print(json.dumps(summary, indent=2))
    return 0 if proof["passed"] else 1


def register(sub) -> None:
    parser = sub.add_parser(
        "prove", help="recovery proof: reference, crash after update k, resume, compare hashes"
    )
    parser.add_argument("recipe", type=Path, help="recipe file (JSON or YAML)")
    parser.add_argument("--input-root", type=Path, default=Path("data"))
    parser.add_argument(
        "--work-dir", type=Path, required=True, help="runs go to WORK/qualification/<proof-id>/"
    )
    parser.add_argument("--out", type=Path, help="also write proof.json here")
    parser.add_argument("--steps", type=int, help="qualification length (default: from cadence)")
    parser.add_argument("--fail-after-step", type=int, metavar="K", help="fault point")
    parser.add_argument("--examples", type=Path, help="prepared examples directory")
    parser.add_argument("--deadline-s", type=float, default=3600.0)
    parser.add_argument("--stall-s", type=float, default=600.0)
    parser.add_argument("--grace-s", type=float, default=30.0)
    parser.set_defaults(func=run)
