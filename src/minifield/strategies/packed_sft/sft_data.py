"""Supervised examples: JSONL reading, the token layout of one example, and the demo dataset.

A supervised file is JSONL, one example per line, in either form::

    {"prompt": "abc", "response": "cba"}
    {"messages": [{"role": "user", "content": "..."}, {"role": "assistant", "content": "..."}]}

A chat example trains on its *last* message, which must come from the
assistant; every earlier message becomes the prompt, rendered as
``<role>: <content>\\n`` lines. Blank lines are skipped. A bad row stops the
read with ``file:line`` and what was expected.

Token layout of one example (the loss covers the response and its ``<eos>``)::

    <bos> prompt-tokens <sep> response-tokens <eos>
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path

from ...atomic import write_bytes
from ...digest import sha256_bytes
from .tokenizer import Tokenizer

ROLES = ("system", "user", "assistant")


class DataError(Exception):
    """A supervised data file that cannot be read as examples; the message names file:line."""


@dataclass(frozen=True)
class Example:
    prompt: str
    response: str
    #: a chat row's messages as given (a base model's chat template renders these)
    messages: tuple | None = field(default=None, compare=False)

    def conversation(self) -> list[dict]:
        """The example as chat messages: a prompt/response row is one user and one assistant turn."""
        if self.messages is not None:
            return [dict(m) for m in self.messages]
        return [
            {"role": "user", "content": self.prompt},
            {"role": "assistant", "content": self.response},
        ]


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


def _from_chat(messages, where: str) -> Example:
    if not isinstance(messages, list) or len(messages) < 2:
        raise DataError(f"{where}: 'messages' must be a list of at least two messages")
    for index, message in enumerate(messages):
        if (
            not isinstance(message, dict)
            or set(message) != {"role", "content"}
            or message["role"] not in ROLES
            or not isinstance(message["content"], str)
        ):
            raise DataError(
                f"{where}: messages[{index}] must be {{'role': one of {list(ROLES)}, "
                f"'content': string}} (got {message!r})"
            )
    if messages[-1]["role"] != "assistant":
        raise DataError(
            f"{where}: the last message is from {messages[-1]['role']!r}; training needs it "
            "to be the assistant's (it is the response)"
        )
    prompt = "".join(f"{m['role']}: {m['content']}\n" for m in messages[:-1])
    return Example(prompt, messages[-1]["content"], tuple(dict(m) for m in messages))


def parse_row(row, where: str) -> Example:
    """One decoded JSON value → Example, or DataError naming ``where``."""
    if not isinstance(row, dict):
        raise DataError(f"{where}: expected a JSON object, got {type(row).__name__}")
    if "messages" in row:
        if set(row) != {"messages"}:
            raise DataError(f"{where}: a chat row has only 'messages' (got keys {sorted(row)})")
        return _from_chat(row["messages"], where)
    if set(row) != {"prompt", "response"}:
        raise DataError(
            f"{where}: expected keys 'prompt' and 'response' (or 'messages'), got {sorted(row)}"
        )
    if not isinstance(row["prompt"], str) or not isinstance(row["response"], str):
        raise DataError(f"{where}: 'prompt' and 'response' must be strings")
    if not row["response"]:
        raise DataError(f"{where}: 'response' is empty (nothing to train on)")
    return Example(row["prompt"], row["response"])


def json_rows(lines, path, error: type[Exception]):
    """``(row, "file:line")`` for every non-blank line of a JSONL file (``lines``: its lines
    in order); a line that is not JSON raises ``error`` naming the file and line."""
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise error(f"{where}: not valid JSON ({exc.msg})") from None
        yield row, where


def read_jsonl(path: Path) -> list[Example]:
    """Every example of a supervised JSONL file; raises DataError with ``file:line`` on a bad row."""
    examples = []
    try:
        handle = open(path, encoding="utf-8")
    except OSError as exc:
        raise DataError(f"{path}: cannot read ({exc.strerror})") from exc
    with handle:
        try:
            for row, where in json_rows(handle, path, DataError):
                examples.append(parse_row(row, where))
        except UnicodeDecodeError as exc:
            raise DataError(f"{path}: not UTF-8 text ({exc})") from exc
    if not examples:
        raise DataError(f"{path}: no examples (the file is empty)")
    return examples


def encode(example: Example, tokenizer: Tokenizer) -> Encoded:
    prompt = [tokenizer.bos_id, *tokenizer.encode(example.prompt), tokenizer.sep_id]
    response = [*tokenizer.encode(example.response), tokenizer.eos_id]
    return Encoded(prompt, response)


# -- the demo dataset -------------------------------------------------------------------------


def encode_file(path: Path, tokenizer: Tokenizer) -> list[Encoded]:
    """Every example of a supervised file, encoded."""
    return [encode(e, tokenizer) for e in read_jsonl(path)]


DEMO_SPLITS = {"train": 4000, "dev": 200, "test": 200}
DEMO_ALPHABET = "abcdefghijklmnopqrstuvwxyz"
DEMO_LENGTHS = (3, 6)
DEMO_SEED = 20260101


def demo_examples(
    seed: int = DEMO_SEED, sizes: dict[str, int] | None = None
) -> dict[str, list[Example]]:
    """Reverse a 3–6 letter string: disjoint train/dev/test splits, answers checkable exactly.

    Deterministic in ``seed`` (Python's ``random.Random`` sequence is stable
    across versions for ``randrange``); no string occurs in two splits.
    """
    sizes = dict(sizes or DEMO_SPLITS)
    rng = random.Random(seed)
    seen: set[str] = set()
    splits: dict[str, list[Example]] = {}
    low, high = DEMO_LENGTHS
    for split, count in sizes.items():
        rows = []
        while len(rows) < count:
            length = low + rng.randrange(high - low + 1)
            word = "".join(DEMO_ALPHABET[rng.randrange(len(DEMO_ALPHABET))] for _ in range(length))
            if word in seen:
                continue
            seen.add(word)
            rows.append(Example(word, word[::-1]))
        splits[split] = rows
    return splits


def to_jsonl(examples: list[Example]) -> bytes:
    return "".join(
        json.dumps({"prompt": e.prompt, "response": e.response}) + "\n" for e in examples
    ).encode("utf-8")


def write_demo(directory: Path, seed: int = DEMO_SEED) -> dict[str, str]:
    """Write ``{split}.jsonl`` into ``directory``; returns split → sha256 (for recipe pins)."""
    directory.mkdir(parents=True, exist_ok=True)
    pins = {}
    for split, rows in demo_examples(seed).items():
        data = to_jsonl(rows)
        write_bytes(directory / f"{split}.jsonl", data)
        pins[split] = sha256_bytes(data)
    return pins
