"""Supervised examples as tokens: the layout of one example, encoded.

Files are read by :mod:`.formats` (messages, ShareGPT, Alpaca, prompt/response, text;
JSONL or Parquet). Without a chat template (the byte tokenizer, or a plain ``tokenizer.json``)
an example is laid out as (the loss covers the response and its ``<eos>``)::

    <bos> prompt-tokens <sep> response-tokens <eos>

A conversation's messages before an assistant turn are ``<role>: <content>\\n`` lines; each
assistant turn follows a ``<sep>`` and ends with ``<eos>``::

    <bos> system: s\\nuser: u1\\n <sep> a1 <eos> user: u2\\n <sep> a2 <eos>

``train_on`` (:data:`.assistant_turns.TRAIN_ON`) says which turns are in the loss: every
assistant turn, the last one only (then the earlier turns are prompt lines, ``assistant:``
included), or every token but the first. A ``text`` row is ``<bos> text <eos>``, all trained.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from .. import schemas
from .formats import DataError, Example, Source, read
from .tokenizer import Tokenizer

__all__ = ["DataError", "Encoded", "Example", "encode", "encode_file", "read_jsonl"]


#: what a conversation trains when the recipe does not say (the schema's ``x-absent``)
TRAIN_ON_ABSENT = schemas.load(schemas.TRAINING)["properties"]["train_on"]["x-absent"]


def recipe_reading(recipe: dict, name: str) -> tuple[Source, str]:
    """How the recipe's input ``name`` is read (its entry's ``format``, ``columns``, ``roles``)
    and what its conversations train (``training.train_on``)."""
    entry = next((i for i in recipe.get("inputs", []) if i.get("name") == name), None)
    return Source.of(entry), recipe["training"].get("train_on", TRAIN_ON_ABSENT)


def normalize_train_on(training: dict) -> None:
    """Drop ``train_on`` spelled at its absent value: both are one computation (one digest)."""
    if training.get("train_on") == TRAIN_ON_ABSENT:
        del training["train_on"]


@dataclass(frozen=True)
class Encoded:
    """One example as tokens: ``prompt`` = ``<bos> p <sep>``; ``response`` = ``r <eos>``.

    ``prompt`` is every token before the first trained one. ``trained`` flags each
    ``response`` token (1 trained, 0 context): a conversation trained on every assistant turn
    carries its later user and tool turns inside ``response`` unflagged. None: all trained.
    """

    prompt: list[int]
    response: list[int]
    trained: tuple[int, ...] | None = None

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.response

    def __len__(self) -> int:
        return len(self.prompt) + len(self.response)

    def response_mask(self) -> list[int]:
        """1/0 per ``response`` token: whether it is in the loss."""
        return [1] * len(self.response) if self.trained is None else list(self.trained)

    def cut(self, length: int) -> Encoded:
        """The first ``length`` tokens of the response (its flags cut alike)."""
        trained = None if self.trained is None else self.trained[:length]
        return Encoded(self.prompt, self.response[:length], trained)

    def last_turn(self) -> Encoded:
        """The last trained run as the response, everything before it as the prompt: what
        exact-match evaluation asks (the conversation so far) and expects (the last answer)."""
        if self.trained is None:
            return self
        mask = self.trained
        end = max(i for i, flag in enumerate(mask) if flag) + 1
        start = end
        while start > 0 and mask[start - 1]:
            start -= 1
        return Encoded(self.prompt + self.response[:start], self.response[start:end])


def read_jsonl(path: Path, source: Source | None = None) -> list[Example]:
    """Every example of a supervised file; raises DataError naming ``file:line`` on a bad row."""
    return read(path, source).examples


def _chat_tokens(messages: list[dict], tokenizer: Tokenizer) -> tuple[list[int], list[int]]:
    """Tokens of a conversation laid out as the module docstring shows, and 1/0 per token:
    whether it belongs to an assistant turn (its ``<eos>`` included)."""
    tokens, flags, context = [tokenizer.bos_id], [0], ""
    for message in messages:
        text = message.get("content") or json.dumps(message.get("tool_calls"))
        if message["role"] != "assistant":
            context += f"{message['role']}: {text}\n"
            continue
        head = [*tokenizer.encode(context), tokenizer.sep_id]
        turn = [*tokenizer.encode(text), tokenizer.eos_id]
        tokens += head + turn
        flags += [0] * len(head) + [1] * len(turn)
        context = ""
    return tokens, flags


def encode(example: Example, tokenizer: Tokenizer, train_on: str = "all_assistant") -> Encoded:
    if example.text:
        return Encoded([tokenizer.bos_id], [*tokenizer.encode(example.response), tokenizer.eos_id])
    turns = sum(m["role"] == "assistant" for m in example.messages or ())
    if train_on == "last_assistant" or turns <= 1 and train_on == "all_assistant":
        prompt = [tokenizer.bos_id, *tokenizer.encode(example.prompt), tokenizer.sep_id]
        response = [*tokenizer.encode(example.response), tokenizer.eos_id]
        return Encoded(prompt, response)
    tokens, flags = _chat_tokens(example.conversation(), tokenizer)
    if train_on == "everything":
        return Encoded(tokens[:1], tokens[1:])
    first = flags.index(1)
    return Encoded(tokens[:first], tokens[first:], tuple(flags[first:]))


def encode_examples(
    examples: list[Example], tokenizer: Tokenizer, train_on: str, path: Path
) -> list[Encoded]:
    """The examples of the supervised file ``path``, encoded (``everything`` refused for a
    conversation with a tool message, naming the example: a tool's output is never trained)."""
    out = []
    for index, example in enumerate(examples, start=1):
        if train_on == "everything" and any(m["role"] == "tool" for m in example.messages or ()):
            raise DataError(
                f"{example.where or f'{path} (example {index})'}: training.train_on=everything "
                "would train a tool's output; use all_assistant or last_assistant for "
                "conversations with tool messages"
            )
        out.append(encode(example, tokenizer, train_on))
    return out


def encode_file(
    path: Path, tokenizer: Tokenizer, source: Source | None = None, train_on: str = "all_assistant"
) -> list[Encoded]:
    """Every example of a supervised file, encoded."""
    return encode_examples(read_jsonl(path, source), tokenizer, train_on, path)


def to_jsonl(examples: list[Example]) -> bytes:
    return "".join(
        json.dumps({"prompt": e.prompt, "response": e.response}) + "\n" for e in examples
    ).encode("utf-8")
