"""``minifield generate --model DIR --prompt TEXT``: generation from an export or an HF directory.

The model is loaded by ``minifield.load_model``; each prompt is the user's turn in the
model's chat template (``--no-chat-template``: raw text continued), and tokens are chosen
greedily unless ``generation_config.json`` says ``do_sample`` or a sampling flag is given
(:mod:`minifield.models.sampling`: the flags win over the file).

Prompts must be UTF-8 text: a ``--prompt`` argument or a stdin line that is not valid UTF-8
is refused (exit 2, naming it) before the model is loaded and before anything is printed; so
is a bad flag value (one line naming the flag) or a bad ``generation_config.json`` field.
A prompt that leaves no position for a new token in the model's context is refused (exit 2,
its length in tokens against the context) before anything is generated: its own tokens are
counted before the chat template renders it, so a prompt far past the context is not met
first by the template sandbox's size bound (which stays, for what a template itself builds),
and then the rendered prompt's."""

from __future__ import annotations

import sys
from pathlib import Path

from ..models import sampling
from . import bounded_float, bounded_int

#: the model runs in this process, on the accelerator where there is one (the other commands
#: start or judge workers and keep off it: minifield.supervision.accelerator)
OPENS_ACCELERATOR = True


class PromptError(ValueError):
    """A prompt that is not UTF-8 text, or too long for the model's context."""


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


def _prompt_ids(model, prompt: str, chat_template: bool, which: str) -> list[int]:
    """The token ids ``model`` generates after (as ``model.generate`` lays the prompt out),
    refused when they leave no position for a new token; ``which``: the prompt, in a message.

    The prompt's own tokens are counted first: a prompt longer than the context cannot fit
    whatever the template adds, and rendering it could pass the template sandbox's bound."""
    context = model.cfg.max_len
    own = len(model.tokenizer.encode(prompt))
    if own >= context:
        raise PromptError(_too_long(which, f"{own:,} tokens", context))
    ids = model.prompt_ids(prompt, chat_template)
    if len(ids) >= context:
        laid_out = (
            "its chat template"
            if chat_template and model.template is not None
            else "special tokens"
        )
        raise PromptError(
            _too_long(which, f"{len(ids):,} tokens with {laid_out} ({own:,} of its own)", context)
        )
    return ids


def _too_long(which: str, length: str, context: int) -> str:
    return (
        f"{which} is {length}, the model's context is {context:,} positions: shorten the "
        "prompt (the context holds the prompt and at least one new token) or use a model "
        "with a longer context"
    )


def run(args) -> int:
    from .. import api

    try:
        prompts = _prompts(args.prompt, sys.stdin)
        model = api.load_model(args.model)
        # the file's defaults and the flags together, judged before anything is printed
        sampling.resolve(model.generation, args.temperature, args.top_k, args.top_p)
        # every prompt laid out and judged against the context before anything is printed
        prompt_ids = [
            _prompt_ids(
                model,
                prompt,
                not args.no_chat_template,
                "the prompt" if len(prompts) == 1 else f"prompt {number} of {len(prompts)}",
            )
            for number, prompt in enumerate(prompts, 1)
        ]
    except (ValueError, OSError) as exc:
        print(f"minifield generate: {exc}", file=sys.stderr)
        return 2
    for ids in prompt_ids:
        try:  # model.generate, from the ids judged above
            new = model.generate_ids(
                ids,
                args.max_new_tokens,
                temperature=args.temperature,
                top_k=args.top_k,
                top_p=args.top_p,
                seed=args.seed,
            )
        except ValueError as exc:
            print(f"minifield generate: {exc}", file=sys.stderr)
            return 2
        print(model.tokenizer.decode(new))
    return 0


def register(sub) -> None:
    parser = sub.add_parser(
        "generate",
        help="generate text from an exported model or an HF model directory",
    )

    def one_line_error(message: str):
        # a bad flag is one line naming it, as every other refusal of this command
        parser.exit(2, f"minifield generate: {message}\n")

    parser.error = one_line_error
    parser.add_argument(
        "--model",
        type=Path,
        required=True,
        help="a minifield export directory (model.json) or an HF directory (config.json, "
        "safetensors weights, tokenizer.json, tokenizer_config.json)",
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
    parser.add_argument(
        "--temperature",
        type=bounded_float(0.0, 1e6),
        help="sample at this temperature (0: greedy; default: generation_config.json's, "
        "else greedy)",
    )
    parser.add_argument(
        "--top-k",
        type=bounded_int(0, 2**31 - 1),
        help="sample from the k most likely tokens (0: all; default: generation_config.json's, "
        "else 50 when sampling)",
    )
    parser.add_argument(
        "--top-p",
        type=bounded_float(0.0, 1.0, above=True),
        help="sample from the nucleus of this probability (default: generation_config.json's, "
        "else 1)",
    )
    parser.add_argument(
        "--seed",
        type=bounded_int(0, sampling.MAX_SEED),
        default=0,
        help="sampling seed: the same seed gives the same text (default 0)",
    )
    parser.add_argument(
        "--no-chat-template",
        action="store_true",
        help="continue the prompt as raw text instead of a user turn in the chat template",
    )
    parser.set_defaults(func=run)
