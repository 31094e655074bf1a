"""``minifield generate --model DIR --prompt TEXT``: greedy generation from an exported model.

Prompts must be UTF-8 text: a ``--prompt`` argument or a stdin line that is not valid UTF-8
is refused (exit 2, naming it) before the model is loaded and before anything is printed."""

from __future__ import annotations

import sys
from pathlib import Path

from ..state import export
from ..strategies.packed_sft import tokenizer as tokenizers
from . import bounded_int


class PromptError(ValueError):
    """A prompt that is not UTF-8 text."""


def _prompts(given: list[str] | None, stdin) -> list[str]:
    """The ``--prompt`` values (whose undecodable argument bytes Python keeps as surrogate
    escapes), or the non-blank lines of ``stdin``'s bytes, decoded strictly."""
    if given:
        for number, prompt in enumerate(given, 1):
            try:
                prompt.encode("utf-8")
            except UnicodeEncodeError as exc:
                raise PromptError(
                    f"--prompt (the {_ordinal(number)}) is not valid UTF-8 text (an undecodable "
                    f"byte at character {exc.start})"
                ) from None
        return given
    prompts = []
    for number, raw in enumerate(stdin.buffer, 1):
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise PromptError(
                f"standard input line {number} is not valid UTF-8 text ({exc.reason} at byte "
                f"{exc.start})"
            ) from None
        if line.strip():
            prompts.append(line.rstrip("\n"))
    return prompts


def _ordinal(number: int) -> str:
    return {1: "first", 2: "second", 3: "third"}.get(number, f"{number}th")


def run(args) -> int:
    from ..strategies.packed_sft.exported import ExportedModel

    try:
        prompts = _prompts(args.prompt, sys.stdin)
        model = ExportedModel(args.model)
    except (export.ExportError, tokenizers.TokenizerError, ValueError, OSError) as exc:
        print(f"minifield generate: {exc}", file=sys.stderr)
        return 2
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
