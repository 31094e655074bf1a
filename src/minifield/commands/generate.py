"""``minifield generate --model DIR --prompt TEXT``: greedy generation from an exported model."""

from __future__ import annotations

import sys
from pathlib import Path

from ..state import export
from ..strategies.packed_sft import tokenizer as tokenizers
from . import bounded_int


def run(args) -> int:
    from ..strategies.packed_sft.strategy import ExportedModel

    try:
        model = ExportedModel(args.model)
    except (export.ExportError, tokenizers.TokenizerError, ValueError, OSError) as exc:
        print(f"minifield generate: {exc}", file=sys.stderr)
        return 2
    prompts = args.prompt or [line.rstrip("\n") for line in sys.stdin if line.strip()]
    for prompt in prompts:
        try:
            print(model.generate(prompt, args.max_new_tokens))
        except ValueError as exc:
            print(f"minifield generate: {exc}", file=sys.stderr)
            return 2
    return 0


def register(sub) -> None:
    parser = sub.add_parser(
        "generate", help="greedy generation from an exported packed-sft model directory"
    )
    parser.add_argument(
        "--model",
        type=Path,
        required=True,
        help="export directory (model.json + weights/, or an HF directory from a llama run)",
    )
    parser.add_argument(
        "--prompt",
        action="append",
        help="prompt text (repeatable; default: one prompt per line of stdin)",
    )
    parser.add_argument(
        "--max-new-tokens",
        type=bounded_int(1, 65536),
        default=64,
        help="at most this many tokens (default 64)",
    )
    parser.set_defaults(func=run)
