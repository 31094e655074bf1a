"""Supervised data files in the formats people have, JSONL or Parquet, read into examples.

One row is one example, in one of these formats (:data:`FORMATS`)::

    messages         {"messages": [{"role": ..., "content": ...}, ...], "tools": [...]?}
    sharegpt         {"conversations": [{"from": "human", "value": ...}, ...]}
    alpaca           {"instruction": ..., "input": ...?, "output": ...}
    prompt_response  {"prompt": ..., "response": ...}
    text             {"text": ...}                      (causal LM: every token trained)

Roles are ``system``, ``user``, ``assistant`` and ``tool`` (an assistant message may carry
``tool_calls`` instead of text; a tool message ``tool_call_id``/``name``). ShareGPT's ``from``
values map to roles by :data:`SHAREGPT_ROLES` plus the input's own ``roles``. An Alpaca row is
the conversation user (``instruction``, then a blank line and ``input`` when there is one) →
assistant (``output``), so it prepares exactly as that ``messages`` row.

A file is JSONL (one JSON object per line, blank lines skipped) or Parquet (what pandas,
pyarrow and ``datasets.to_parquet`` write: one row per example, nested lists of structs for
conversations), told apart by Parquet's ``PAR1`` magic bytes. The format is the input's
``format`` or, absent, detected from the first row; every row must have the same shape, so a
mixed file is refused naming the ``file:line`` (Parquet: ``file (row N)``, counted from 0).
``columns`` renames the file's fields to a format's (``{"messages": "dialogue"}``). Any bad row
stops the read with a :class:`DataError` naming the file, the row and the field.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from functools import cached_property
from pathlib import Path

from ..inputs.pinned import InputError

FORMATS = ("messages", "sharegpt", "alpaca", "prompt_response", "text")
#: format → (required fields, optional fields)
FIELDS = {
    "messages": ({"messages"}, {"tools"}),
    "sharegpt": ({"conversations"}, {"tools"}),
    "alpaca": ({"instruction", "output"}, {"input"}),
    "prompt_response": ({"prompt", "response"}, set()),
    "text": ({"text"}, set()),
}
ROLES = ("system", "user", "assistant", "tool")
#: keys a message may have besides ``role`` and ``content``
MESSAGE_EXTRAS = {"tool_calls", "tool_call_id", "name"}
SHAREGPT_ROLES = {"human": "user", "gpt": "assistant", "system": "system", "tool": "tool"}
PARQUET_MAGIC = b"PAR1"


class DataError(InputError):
    """A supervised data file that cannot be read as examples; the message names file:line
    (an invalid input: the worker exits 2)."""


@dataclass(frozen=True)
class Example:
    prompt: str
    response: str
    #: a conversation's messages as given (a chat template renders these)
    messages: tuple | None = field(default=None, compare=False)
    #: a conversation's tool definitions (the template's ``tools``)
    tools: tuple | None = field(default=None, compare=False)
    #: a ``text`` row: raw text trained whole (``response``), no prompt
    text: bool = False
    #: where the row is, ``file:line`` (Parquet: ``file (row N)``): what a failure names
    where: str | None = field(default=None, compare=False)

    def conversation(self) -> list[dict]:
        """The example as chat messages: a prompt/response row is one user and one assistant turn."""
        if self.messages is not None:
            return [dict(m) for m in self.messages]
        return [
            {"role": "user", "content": self.prompt},
            {"role": "assistant", "content": self.response},
        ]


@dataclass(frozen=True)
class Source:
    """How one input file is read: its format (None: detected), field and role names."""

    format: str | None = None
    columns: dict = field(default_factory=dict)
    roles: dict = field(default_factory=dict)

    @classmethod
    def of(cls, entry: dict | None) -> Source:
        """The settings of a recipe's input entry (``format``, ``columns``, ``roles``)."""
        entry = entry or {}
        return cls(
            entry.get("format"), dict(entry.get("columns", {})), dict(entry.get("roles", {}))
        )

    @cached_property
    def renames(self) -> dict:
        """A file's field name -> the format's (``columns`` inverted), built once per file."""
        return {file_name: name for name, file_name in self.columns.items()}


@dataclass(frozen=True)
class Read:
    """A file's examples and the format they were read as (``detected``: not declared)."""

    examples: list[Example]
    format: str
    detected: bool

    def record(self) -> dict:
        """What the prepared manifest records of the decision."""
        return record(self.format, self.detected, len(self.examples))


def record(fmt: str, detected: bool, count: int) -> dict:
    """What the prepared manifest records of a file's format decision (:meth:`Read.record`)."""
    return {"format": fmt, "detected": detected, "examples": count}


def json_rows(lines, path, error: type[Exception], start: int = 1):
    """``(row, "file:line")`` for every non-blank line of a JSONL file (``lines``: its lines
    in order, the first being line ``start``); a line that is not JSON raises ``error`` naming
    the file and line."""
    for number, line in enumerate(lines, start=start):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise error(f"{where}: not valid JSON ({exc.msg})") from None
        yield row, where


def _parquet_rows(path: Path, source: Source):
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except (OSError, pa.ArrowException) as exc:
        raise DataError(f"{path}: not a readable Parquet file ({exc})") from None
    columns = set(table.column_names)
    if source.format is not None:
        required, optional = FIELDS[source.format]
        required = {source.columns.get(k, k) for k in required}
        allowed = required | {source.columns.get(k, k) for k in optional}
        if not required <= columns or not columns <= allowed:
            raise DataError(
                f"{path}: Parquet columns {sorted(columns)} are not those of format "
                f"{source.format!r} (required {sorted(required)}, optional "
                f"{sorted(allowed - required)})"
            )
    for index, row in enumerate(table.to_pylist()):
        yield _without_nulls(row), f"{path} (row {index})"


def _without_nulls(value):
    """A Parquet struct has every field any row has: an absent one reads as None (dropped)."""
    if isinstance(value, dict):
        return {k: _without_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_without_nulls(v) for v in value]
    return value


def is_parquet(path: Path) -> bool:
    """Whether ``path`` is a Parquet file (by its first bytes); OSError where unreadable."""
    with open(path, "rb") as handle:
        return handle.read(4) == PARQUET_MAGIC


def rows(path: Path, source: Source):
    """``(row, where)`` of every example row of a JSONL or Parquet file."""
    try:
        parquet = is_parquet(path)
    except OSError as exc:
        raise DataError(f"{path}: cannot read ({exc.strerror})") from exc
    if parquet:
        yield from _parquet_rows(path, source)
        return
    with open(path, encoding="utf-8") as handle:
        try:
            yield from json_rows(handle, path, DataError)
        except UnicodeDecodeError as exc:
            raise DataError(f"{path}: not UTF-8 text ({exc})") from exc


def shape(row: dict) -> str | None:
    """The format whose fields ``row`` has (required ones all, optional ones at most)."""
    keys = set(row)
    for name, (required, optional) in FIELDS.items():
        if required <= keys <= required | optional:
            return name
    return None


def _string(row: dict, key: str, where: str) -> str:
    value = row[key]
    if not isinstance(value, str):
        raise DataError(f"{where}: {key!r} must be a string (got {type(value).__name__})")
    return value


def parse_message(message, index: int, where: str, field_name: str = "messages") -> dict:
    at = f"{where}: {field_name}[{index}]"
    if not isinstance(message, dict) or "role" not in message:
        raise DataError(f"{at} must be an object with 'role' and 'content' (got {message!r})")
    extra = set(message) - {"role", "content"} - MESSAGE_EXTRAS
    if extra:
        raise DataError(f"{at} has unknown fields {sorted(extra)}")
    role, content = message["role"], message.get("content")
    if role not in ROLES:
        raise DataError(f"{at}.role is {role!r}, not one of {list(ROLES)}")
    calls = message.get("tool_calls")
    if calls is not None and (role != "assistant" or not isinstance(calls, list) or not calls):
        raise DataError(f"{at}.tool_calls must be a non-empty list on an assistant message")
    if content is None and calls is None or content is not None and not isinstance(content, str):
        raise DataError(f"{at}.content must be a string (got {content!r})")
    if role == "assistant" and calls is None and not content.strip():
        raise DataError(f"{at}.content is empty: an assistant turn must say something to train")
    return dict(message)


def _legacy_prompt(messages: list[dict]) -> str:
    return "".join(f"{m['role']}: {m.get('content') or ''}\n" for m in messages[:-1])


def chat_example(messages, where: str, tools=None, field_name: str = "messages") -> Example:
    """A conversation (checked: roles, contents, an assistant turn, ending with one)."""
    if not isinstance(messages, list) or len(messages) < 2:
        raise DataError(f"{where}: {field_name!r} must be a list of at least two messages")
    checked = [parse_message(m, i, where, field_name) for i, m in enumerate(messages)]
    if not any(m["role"] == "assistant" for m in checked):
        raise DataError(f"{where}: {field_name!r} has no assistant turn (nothing to train on)")
    if checked[-1]["role"] != "assistant":
        raise DataError(
            f"{where}: the last message is from {checked[-1]['role']!r}; training needs it "
            "to be the assistant's (nothing after the last answer is trained)"
        )
    if tools is not None and not isinstance(tools, list):
        raise DataError(f"{where}: 'tools' must be a list of tool definitions")
    last = checked[-1].get("content") or json.dumps(checked[-1].get("tool_calls"))
    return Example(
        _legacy_prompt(checked),
        last,
        tuple(checked),
        None if tools is None else tuple(tools),
    )


def _sharegpt(turns, where: str, roles: dict, tools) -> Example:
    if not isinstance(turns, list):
        raise DataError(f"{where}: 'conversations' must be a list of {{from, value}} turns")
    messages = []
    for index, turn in enumerate(turns):
        at = f"{where}: conversations[{index}]"
        if not isinstance(turn, dict) or set(turn) != {"from", "value"}:
            raise DataError(f"{at} must be {{'from': ..., 'value': ...}} (got {turn!r})")
        if turn["from"] not in roles:
            raise DataError(
                f"{at}.from is {turn['from']!r}, not in the role mapping {sorted(roles)} (add "
                "it to the input's 'roles')"
            )
        messages.append({"role": roles[turn["from"]], "content": turn["value"]})
    return chat_example(messages, where, tools, "conversations")


def _alpaca(row: dict, where: str) -> Example:
    instruction, output = _string(row, "instruction", where), _string(row, "output", where)
    extra = _string(row, "input", where) if row.get("input") else ""
    user = f"{instruction}\n\n{extra}" if extra else instruction
    return chat_example(
        [{"role": "user", "content": user}, {"role": "assistant", "content": output}], where
    )


def example(row: dict, fmt: str, where: str, source: Source) -> Example:
    """One row of format ``fmt`` (its fields already renamed) → Example."""
    if fmt == "messages":
        return chat_example(row["messages"], where, row.get("tools"))
    if fmt == "sharegpt":
        return _sharegpt(
            row["conversations"], where, {**SHAREGPT_ROLES, **source.roles}, row.get("tools")
        )
    if fmt == "alpaca":
        return _alpaca(row, where)
    if fmt == "text":
        text = _string(row, "text", where)
        if not text:
            raise DataError(f"{where}: 'text' is empty (nothing to train on)")
        return Example("", text, text=True)
    prompt, response = _string(row, "prompt", where), _string(row, "response", where)
    if not response:
        raise DataError(f"{where}: 'response' is empty (nothing to train on)")
    return Example(prompt, response)


def row_example(row, where: str, fmt: str | None, source: Source, first: bool):
    """``(Example, format)`` of one row (``where``: its ``file:line``; ``fmt``: the file's
    format so far, None before its first row, which decides it; ``first``: the file's first
    row): checked, its fields renamed by ``source.columns``."""
    if not isinstance(row, dict):
        raise DataError(f"{where}: expected a JSON object, got {type(row).__name__}")
    if source.columns:
        names = source.renames
        row = {names.get(k, k): v for k, v in row.items()}
    found = shape(row)
    if fmt is None:
        fmt = found
    if found != fmt or fmt is None:
        expected = fmt or "any format"
        required, optional = FIELDS.get(fmt, (set(), set()))
        raise DataError(
            f"{where}: fields {sorted(row)} are not those of {expected!r}"
            + (
                f" (required {sorted(required)}, optional {sorted(optional)})"
                if fmt
                else f" (one of {list(FORMATS)})"
            )
            + ("" if source.format or first else "; a file holds one shape")
        )
    return replace(example(row, fmt, where, source), where=where), fmt


def read(path: Path, source: Source | None = None) -> Read:
    """Every example of a supervised file (see the module docstring)."""
    source = source or Source()
    if source.format is not None and source.format not in FORMATS:
        raise DataError(f"{path}: format {source.format!r} is not one of {list(FORMATS)}")
    examples, fmt = [], source.format
    for row, where in rows(path, source):
        one, fmt = row_example(row, where, fmt, source, not examples)
        examples.append(one)
    if not examples:
        raise DataError(f"{path}: no examples (the file is empty)")
    return Read(examples, fmt, source.format is None)
