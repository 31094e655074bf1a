"""``minifield make-demo-data DIR``: write the deterministic demo dataset (train/dev/test JSONL)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from ..strategies import packed_sft
from . import bounded_int


def _run_llama(args) -> int:
    """The Llama demo's inputs under ``args.directory`` (an input root) and, with
    ``--llama-base RECIPE``, the base model trained by that recipe into ``llama-base/``."""
    import tempfile

    from .. import api

    try:
        seed = packed_sft.demo_data.SEED if args.seed is None else args.seed
        pins = packed_sft.demo_data.write(args.directory, seed=seed)
        print(json.dumps(pins, indent=2))
        if args.llama_base is None:
            return 0
        command = f"minifield make-demo-data {args.directory} --llama-base {args.llama_base}"
        checked = api.validate(args.llama_base)
        if not checked.valid:
            problems = "; ".join(f"{e['path']}: {e['message']}" for e in checked.errors)
            raise packed_sft.demo_data.ProduceError(
                f"{args.llama_base}: not a valid recipe ({problems})"
            )
        with tempfile.TemporaryDirectory(prefix="minifield-llama-base-") as work:
            # trained from its random initialisation on the inputs just written
            result = api.run(checked, input_root=args.directory, output_root=Path(work))
            provenance = packed_sft.demo_data.produce_base(
                args.directory, args.llama_base, result, command
            )
    except OSError as exc:
        print(f"minifield make-demo-data: cannot write {args.directory}: {exc}", file=sys.stderr)
        return 2
    except packed_sft.demo_data.ProduceError as exc:
        print(f"minifield make-demo-data: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(provenance, indent=2))
    return 0


def run(args) -> int:
    for which in ("two_stage", "preference", "grpo"):
        if getattr(args, which):
            return _derived(args.directory, which)
    if args.llama or args.llama_base is not None:
        return _run_llama(args)
    try:
        seed = packed_sft.demo_data.DEMO_SEED if args.seed is None else args.seed
        pins = packed_sft.demo_data.write_demo(args.directory, seed=seed)
    except OSError as exc:
        print(f"minifield make-demo-data: cannot write {args.directory}: {exc}", file=sys.stderr)
        return 2
    print(
        json.dumps(
            {
                split: {"path": str(args.directory / f"{split}.jsonl"), "sha256": sha}
                for split, sha in pins.items()
            },
            indent=2,
        )
    )
    return 0


def _derived(directory: Path, which: str) -> int:
    """A demo's inputs derived from files already under ``directory`` (an input root):
    ``which`` is ``two_stage`` (word-completion pairs from ``corpus/train.jsonl``),
    ``preference`` or ``grpo`` (pairs or prompts from ``llama-sft-demo/*.jsonl``)."""
    from ..inputs.pinned import InputError
    from ..strategies import grpo, preference, two_stage

    try:
        if which == "two_stage":
            sft = directory / "sft"
            hashes = two_stage.demo_data.write_pairs(directory / "corpus", sft)
            pins = {s: {"path": str(sft / f"{s}.jsonl"), "sha256": h} for s, h in hashes.items()}
        else:
            strategy = preference if which == "preference" else grpo
            pins = strategy.demo_data.write(directory)
    except (OSError, InputError) as exc:
        print(f"minifield make-demo-data: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(pins, indent=2))
    return 0


def register(sub) -> None:
    parser = sub.add_parser(
        "make-demo-data",
        help="write the packed-sft demo dataset (reverse 3-6 letter strings) as JSONL splits",
    )
    parser.add_argument("directory", type=Path, help="where train/dev/test.jsonl are written")
    parser.add_argument(
        "--seed",
        type=bounded_int(0, 2**63 - 1),
        default=None,
        help="generator seed (default: the demo's)",
    )
    parser.add_argument(
        "--llama",
        action="store_true",
        help="write the Llama demo's inputs instead, DIR being the input root: "
        "llama-base/tokenizer.json, llama-base/pretrain/*.jsonl, llama-sft-demo/*.jsonl",
    )
    parser.add_argument(
        "--llama-base",
        type=Path,
        metavar="RECIPE",
        help="as --llama, then train the base model RECIPE (config/recipes/llama-base.yaml) "
        "from random init and write its HF export, chat template and provenance.json into "
        "DIR/llama-base/ (minutes)",
    )
    parser.add_argument(
        "--two-stage",
        action="store_true",
        help="instead: derive the two-stage demo's word-completion pairs DIR/sft/*.jsonl from "
        "the shipped corpus DIR/corpus/train.jsonl (data/two-stage, docs/two-stage.md)",
    )
    parser.add_argument(
        "--preference",
        action="store_true",
        help="instead: derive the preference demo's pairs DIR/preference-demo/*.jsonl (chosen: "
        "the mirror answer, rejected: a near miss) from DIR/llama-sft-demo/*.jsonl "
        "(docs/preference.md)",
    )
    parser.add_argument(
        "--grpo",
        action="store_true",
        help="instead: derive the grpo demos' prompts DIR/grpo-demo/*.jsonl and "
        "DIR/grpo-learn/*.jsonl ({prompt, answer}: the mirror task, its answer checked by the "
        "reward, never shown) from DIR/llama-sft-demo/*.jsonl (docs/grpo-demo.md)",
    )
    parser.set_defaults(func=run)
