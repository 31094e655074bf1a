"""``minifield prove RECIPE``: run the recovery proof of a recipe and write proof.json.

Exit 0 when the proof passed, 1 when it did not (the diagnosis says why), 2 on
bad usage or an invalid recipe.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from ..proof.document import DEFAULT_MODE, MODES
from ..proof.prove import prove
from ..supervision import supervise as supervisor
from . import add_supervision_arguments, supervision_settings


def run(args) -> int:
    # imported here: loading the CLI (e.g. for `minifield supervise`) should not load JAX
    from .. import recipe as recipes

    supervision = supervision_settings("prove", args)
    if supervision is None:
        return 2
    try:
        proof = prove(
            args.recipe,
            args.input_root,
            args.work_dir,
            args.out,
            steps=args.steps,
            fail_after_step=args.fail_after_step,
            mode=args.mode,
            examples_dir=args.examples,
            quantized_base_dir=args.quantized_base,
            supervision=supervision,
        )
    except recipes.RecipeError as exc:
        print(str(exc), file=sys.stderr)
        return 2
    summary = {
        "passed": proof["passed"],
        "mode": proof["settings"]["mode"],
        "diagnosis": proof["diagnosis"],
        "checkpoint_used": proof["checkpoint_used"],
        "first_divergence": proof["first_divergence"],
        "preempted": {
            key: (proof["preempted"] or {}).get(key)
            for key in ("passed", "receipt", "first_divergence")
        }
        if proof["preempted"] is not None
        else None,
        "proof": str(args.out or Path(proof["proof_dir"]) / "proof.json"),
        "seconds": round(proof["seconds"], 3),
    }
    print(json.dumps(summary, indent=2))
    return 0 if proof["passed"] else 1


def register(sub) -> None:
    parser = sub.add_parser(
        "prove",
        help="recovery proof: reference, crash and/or preemption after update k, resume, "
        "compare hashes",
    )
    parser.add_argument("recipe", type=Path, help="recipe file (JSON or YAML)")
    parser.add_argument("--input-root", type=Path, default=Path("data"))
    parser.add_argument(
        "--work-dir", type=Path, required=True, help="runs go to WORK/qualification/<proof-id>/"
    )
    parser.add_argument("--out", type=Path, help="also write proof.json here")
    parser.add_argument("--steps", type=int, help="qualification length (default: from cadence)")
    parser.add_argument(
        "--fail-after-step", type=int, metavar="K", help="crash/preemption point (default every+1)"
    )
    parser.add_argument(
        "--mode",
        choices=MODES,
        default=DEFAULT_MODE,
        help="interruption(s) to prove recovery from: a crash, a preemption (SIGTERM through "
        f"the supervisor, exit 3) or both (default {DEFAULT_MODE})",
    )
    parser.add_argument("--examples", type=Path, help="prepared examples directory")
    parser.add_argument(
        "--quantized-base",
        type=Path,
        help="the recipe's quantized base (the pipeline's quantize_base rule makes it)",
    )
    add_supervision_arguments(parser, supervisor.QUALIFICATION)
    parser.set_defaults(func=run)
