"""Prompt files: rows of prompts and the columns the rewards read, rendered for generation.

One row (JSONL or Parquet, :func:`minifield.data.formats.rows`) is one prompt, in the shapes
TRL's GRPO uses::

    {"prompt": "text" | [messages], "answer": ..., ...}
    {"messages": [messages], ...}

A string is one user turn. The prompt is rendered with the base model's chat template and
``add_generation_prompt``, then tokenized; every other column is kept as it is and handed to
the rewards (one value per completion). A bad row, a column a reward reads missing from a
row, or a prompt that leaves fewer than ``rl.max_completion_length`` slots of
``training.seq_len`` is a :class:`~minifield.data.formats.DataError` naming the file, the row
and the field (an invalid input: exit 2).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ...data import chat_template, formats
from ...data.formats import DataError

PROMPT_KEYS = ("prompt", "messages")


@dataclass(frozen=True)
class PromptRow:
    """One row: the prompt as the file gives it, its messages, the other columns."""

    prompt: object  # a string or a list of messages, as in the file (what rewards receive)
    messages: list[dict]
    columns: dict
    where: str


def prompt_row(row, where: str, needed: list[str]) -> PromptRow:
    if not isinstance(row, dict):
        raise DataError(f"{where}: expected a JSON object, got {type(row).__name__}")
    keys = [key for key in PROMPT_KEYS if key in row]
    if len(keys) != 1:
        raise DataError(
            f"{where}: a prompt row has exactly one of 'prompt' or 'messages' (got {keys or 'none'})"
        )
    value = row[keys[0]]
    if isinstance(value, str):
        if not value.strip():
            raise DataError(f"{where}: {keys[0]!r} is empty")
        messages = [{"role": "user", "content": value}]
    elif isinstance(value, list) and value:
        messages = [formats.parse_message(m, i, where, keys[0]) for i, m in enumerate(value)]
        if messages[-1]["role"] == "assistant":
            raise DataError(
                f"{where}: {keys[0]!r} ends with an assistant message; the policy writes that"
            )
    else:
        raise DataError(f"{where}: {keys[0]!r} must be a string or a non-empty list of messages")
    columns = {k: v for k, v in row.items() if k != keys[0]}
    for name in needed:
        if name not in columns:
            raise DataError(f"{where}: missing column {name!r}, which a reward reads (rl.rewards)")
    return PromptRow(value, messages, columns, where)


def read(path: Path, needed: list[str]) -> list[PromptRow]:
    rows = [prompt_row(row, where, needed) for row, where in formats.rows(path, formats.Source())]
    if not rows:
        raise DataError(f"{path}: no prompts (the file is empty)")
    return rows


def encode(rows: list[PromptRow], tokenizer, template, room: int) -> list[list[int]]:
    """Each prompt's token ids (the chat template's generation prompt at the end); a prompt
    longer than ``room`` tokens is refused naming its row."""
    out = []
    for row in rows:
        try:
            text = template.render(row.messages, add_generation_prompt=True)
        except chat_template.ChatTemplateError as exc:
            raise DataError(f"{row.where}: {exc}") from None
        ids = list(tokenizer.backend.encode(text, add_special_tokens=False).ids)
        if len(ids) > room:
            raise DataError(
                f"{row.where}: the prompt is {len(ids)} tokens; training.seq_len minus "
                f"rl.max_completion_length leaves {room}"
            )
        out.append(ids)
    return out


def to_arrays(rows: list[PromptRow], ids: list[list[int]], pad_id: int, split: str) -> dict:
    """``{split}_prompt_tokens [P, longest]`` (right-padded), ``{split}_prompt_lengths [P]``
    and ``{split}_rows``: the rows as JSON (prompt and columns), what the rewards receive."""
    longest = max(len(i) for i in ids)
    tokens = np.full((len(ids), longest), pad_id, np.int32)
    for index, one in enumerate(ids):
        tokens[index, : len(one)] = one
    records = [{"prompt": r.prompt, "columns": r.columns} for r in rows]
    text = json.dumps(records, sort_keys=True, ensure_ascii=False).encode("utf-8")
    return {
        f"{split}_prompt_tokens": tokens,
        f"{split}_prompt_lengths": np.asarray([len(i) for i in ids], np.int32),
        f"{split}_rows": np.frombuffer(text, np.uint8),
    }


def rows_of(arrays: dict, split: str) -> list[dict]:
    """The rows :func:`to_arrays` stored: ``{"prompt", "columns"}`` each."""
    return json.loads(np.asarray(arrays[f"{split}_rows"]).tobytes().decode("utf-8"))


def prompt_ids(arrays: dict, split: str) -> list[list[int]]:
    tokens, lengths = arrays[f"{split}_prompt_tokens"], arrays[f"{split}_prompt_lengths"]
    return [np.asarray(tokens[i, :n]).tolist() for i, n in enumerate(np.asarray(lengths))]
