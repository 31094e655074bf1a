"""Preference pair files, rendered with the base model's chat template and packed into rows.

One row of a pair file (JSONL or Parquet, :func:`minifield.data.formats.rows`) is one
pair, in the shapes TRL uses::

    {"prompt": "text" | [messages], "chosen": answer, "rejected": answer}
    {"messages": [messages], "chosen": answer, "rejected": answer}

An answer is a string, one assistant message, or a list holding one assistant message. The
prompt (a string is one user turn) is rendered with ``add_generation_prompt`` and each answer
as the assistant turn after it, through its end-of-turn token
(:func:`minifield.data.assistant_turns.encode_many`, the last assistant turn trained).

Packing (:func:`pack`): a pair is two segments, prompt + chosen and prompt + rejected, one
after the other in the same row, so both answers are always in the same update and neither
is padded to the other's length. Pairs fill rows by first-fit decreasing on their two
segments' total length. Per row: ``tokens``, ``segments`` (pair ``k``'s chosen answer is
segment ``2k + 1``, its rejected ``2k + 2``; 0 padding), ``positions`` (restarting per
segment), ``loss_mask`` (1 on answer tokens), and ``pair_index`` (``[rows, M]``: which pair of
the file each of the row's ``M`` pair slots holds, −1 for none): a :class:`PairRows`, what the
preference update and its evaluation receive. A pair longer than
``seq_len`` is cut (both answers shortened, the longer first) or dropped, as
``training.overlong`` says, and counted.

Every bad row is a :class:`minifield.data.formats.DataError` (an invalid input: exit 2)
naming the file, the row and the field.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from ...data import assistant_turns, chat_template, formats
from ...data.encode_pool import ENCODE_BATCH
from ...data.formats import DataError
from ...data.packing import OVERLONG, ROW_FIELDS, first_fit_decreasing

ANSWERS = ("chosen", "rejected")


class PairRows(NamedTuple):
    """Packed pairs (the module docstring): the fields of
    :class:`minifield.data.packing.Rows`, each pair slot's pair, and, in a training batch of
    a loss with a reference (:mod:`.batches`), each slot's reference log-probabilities (0 for
    an empty slot). A JAX pytree with fixed fields: a field left None holds no array, so a
    recipe's batches have one structure and compile once."""

    tokens: Any  # [B, T] int32
    segments: Any  # [B, T] int32: pair slot k's chosen answer 2k + 1, rejected 2k + 2
    positions: Any  # [B, T] int32
    loss_mask: Any  # [B, T] float32: 1 on answer tokens
    pair_index: Any  # [B, M] int32: the pair of the file in each slot, -1 for none
    ref_chosen: Any = None  # [B, M] float32: the reference's chosen answer log-probability
    ref_rejected: Any = None  # [B, M] float32: and its rejected one

    @classmethod
    def of(cls, arrays, prefix: str) -> PairRows:
        """The packed pairs prepared arrays hold under ``{prefix}_{field}`` (no reference)."""
        return cls(*(arrays[f"{prefix}_{name}"] for name in PAIR_FIELDS))

    def named(self, prefix: str) -> dict[str, np.ndarray]:
        """The packed pairs as prepared arrays, ``{prefix}_{field}`` (no reference)."""
        return {f"{prefix}_{name}": getattr(self, name) for name in PAIR_FIELDS}


#: the fields packing writes (a prepared split holds these, rows stacked)
PAIR_FIELDS = (*ROW_FIELDS, "pair_index")
#: the fields a training batch adds with a reference (a prepared split of a recipe with one
#: holds them too, per pair slot)
REF_FIELDS = ("ref_chosen", "ref_rejected")


@dataclass(frozen=True)
class Pair:
    """One row of a pair file: the prompt's messages and the two assistant messages."""

    prompt: list[dict]
    chosen: dict
    rejected: dict
    where: str


@dataclass(frozen=True)
class EncodedPair:
    """A pair as tokens: the rendered prompt (through the generation prompt) and each answer
    (through its end-of-turn token)."""

    prompt: list[int]
    chosen: list[int]
    rejected: list[int]

    def __len__(self) -> int:
        return 2 * len(self.prompt) + len(self.chosen) + len(self.rejected)


def _answer(row: dict, key: str, where: str) -> dict:
    value = row[key]
    if isinstance(value, list):
        if len(value) != 1:
            raise DataError(
                f"{where}: {key!r} must be a string, one assistant message or a list of one "
                f"(got a list of {len(value)})"
            )
        value = value[0]
    if isinstance(value, str):
        value = {"role": "assistant", "content": value}
    message = formats.parse_message(value, 0, where, key) if isinstance(value, dict) else None
    if message is None or message["role"] != "assistant" or "tool_calls" in message:
        raise DataError(
            f"{where}: {key!r} must be a string or an assistant message with text content "
            f"(got {row[key]!r})"
        )
    return message


def _prompt(row: dict, where: str) -> list[dict]:
    key = "prompt" if "prompt" in row else "messages"
    value = row[key]
    if isinstance(value, str):
        if not value.strip():
            raise DataError(f"{where}: 'prompt' is empty")
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise DataError(f"{where}: {key!r} must be a string or a non-empty list of messages")
    messages = [formats.parse_message(m, i, where, key) for i, m in enumerate(value)]
    if messages[-1]["role"] == "assistant":
        raise DataError(
            f"{where}: {key!r} ends with an assistant message; the answers are 'chosen' and "
            "'rejected'"
        )
    return messages


def pair(row, where: str) -> Pair:
    """One checked row (see the module docstring)."""
    if not isinstance(row, dict):
        raise DataError(f"{where}: expected a JSON object, got {type(row).__name__}")
    prompts = [key for key in ("prompt", "messages") if key in row]
    missing = [key for key in ANSWERS if key not in row] + ([] if prompts else ["prompt"])
    if missing:
        raise DataError(
            f"{where}: missing field {missing[0]!r} (a pair has prompt or "
            "messages, chosen and rejected)"
        )
    unknown = sorted(set(row) - {"prompt", "messages", *ANSWERS})
    if len(prompts) > 1 or unknown:
        raise DataError(
            f"{where}: unexpected fields {unknown or prompts} (a pair has one of "
            "prompt or messages, chosen and rejected)"
        )
    chosen, rejected = (_answer(row, key, where) for key in ANSWERS)
    if chosen["content"] == rejected["content"]:
        raise DataError(f"{where}: 'chosen' equals 'rejected' (a pair must differ)")
    return Pair(_prompt(row, where), chosen, rejected, where)


def read(path: Path) -> list[Pair]:
    """Every pair of a JSONL or Parquet pair file."""
    pairs = [pair(row, where) for row, where in formats.rows(path, formats.Source())]
    if not pairs:
        raise DataError(f"{path}: no pairs (the file is empty)")
    return pairs


def encode(pairs: list[Pair], tokenizer, template) -> list[EncodedPair]:
    """Each pair rendered with ``template`` and tokenized (a failure names the row)."""
    backend, eos = tokenizer.backend, tokenizer.eos_id
    end_ids = assistant_turns.end_of_turn_ids(backend, eos)
    out = []
    for start in range(0, len(pairs), ENCODE_BATCH // 2):
        chunk = pairs[start : start + ENCODE_BATCH // 2]
        conversations = [
            assistant_turns.Conversation([*p.prompt, answer], f"{p.where} ({key!r})")
            for p in chunk
            for key, answer in zip(ANSWERS, (p.chosen, p.rejected), strict=True)
        ]
        try:
            encoded = assistant_turns.encode_many(
                conversations, template, backend, eos, "last_assistant", end_ids
            )
        except chat_template.ChatTemplateError as exc:
            raise DataError(str(exc)) from None
        for index, p in enumerate(chunk):
            chosen, rejected = encoded[2 * index], encoded[2 * index + 1]
            if chosen.prompt != rejected.prompt:
                raise DataError(
                    f"{p.where}: the chat template renders the prompt differently before the "
                    "chosen and the rejected answer, so they cannot share it"
                )
            out.append(EncodedPair(chosen.prompt, chosen.response, rejected.response))
    return out


def fit(p: EncodedPair, seq_len: int, overlong: str) -> tuple[EncodedPair | None, str]:
    """``(pair or None, "kept" | "truncated" | "rejected")`` for a row of ``seq_len`` slots.

    Cutting shortens the longer answer first, so that both keep as many tokens as they can;
    a pair whose prompt leaves an answer no token is rejected."""
    if overlong not in OVERLONG:
        raise ValueError(f"overlong must be one of {OVERLONG}, got {overlong!r}")
    if len(p) <= seq_len:
        return p, "kept"
    room = seq_len - 2 * len(p.prompt)  # answer tokens the row holds
    if overlong == "reject" or room < 2:
        return None, "rejected"
    keep_short = min(len(p.chosen), len(p.rejected), room // 2)
    keep_long = room - keep_short
    if len(p.chosen) <= len(p.rejected):
        keep_c, keep_r = keep_short, keep_long
    else:
        keep_c, keep_r = keep_long, keep_short
    return EncodedPair(p.prompt, p.chosen[:keep_c], p.rejected[:keep_r]), "truncated"


@dataclass(frozen=True)
class PackedPairs:
    rows: PairRows
    stats: dict


def pack(pairs: list[EncodedPair], seq_len: int, overlong: str, pad_id: int) -> PackedPairs:
    """Rows of whole pairs (see the module docstring); ``stats`` counts kept, truncated and
    rejected pairs and the slots' efficiency."""
    kept, counts = [], {"kept": 0, "truncated": 0, "rejected": 0}
    for index, one in enumerate(pairs):
        fitted, outcome = fit(one, seq_len, overlong)
        counts[outcome] += 1
        if fitted is not None:
            kept.append((index, fitted))
    bins = first_fit_decreasing([len(p) for _, p in kept], seq_len)
    rows, width = len(bins), max((len(b) for b in bins), default=1)
    out = PairRows(
        tokens=np.full((rows, seq_len), pad_id, np.int32),
        segments=np.zeros((rows, seq_len), np.int32),
        positions=np.zeros((rows, seq_len), np.int32),
        loss_mask=np.zeros((rows, seq_len), np.float32),
        pair_index=np.full((rows, width), -1, np.int32),
    )
    for row, members in enumerate(bins):
        offset = 0
        for slot, member in enumerate(members):
            index, p = kept[member]
            out.pair_index[row, slot] = index
            for side, answer in enumerate((p.chosen, p.rejected)):
                n = len(p.prompt) + len(answer)
                span = slice(offset, offset + n)
                out.tokens[row, span] = p.prompt + answer
                out.segments[row, span] = 2 * slot + side + 1
                out.positions[row, span] = np.arange(n)
                out.loss_mask[row, offset + len(p.prompt) : offset + n] = 1.0
                offset += n
    real = sum(len(p) for _, p in kept)
    stats = {
        "pairs": len(pairs),
        "packed": len(kept),
        **counts,
        "rows": rows,
        "pairs_per_row": width,
        "seq_len": seq_len,
        "real_tokens": real,
        "answer_tokens": int(out.loss_mask.sum()),
        "slots": rows * seq_len,
        "efficiency": real / (rows * seq_len) if rows else 0.0,
    }
    return PackedPairs(out, stats)


def unpack(rows: PairRows) -> dict[int, EncodedPair]:
    """The pairs packed rows hold, by pair index: each segment's tokens split at its first
    answer token (the inverse of :func:`pack` for the pairs it kept)."""
    out = {}
    for row, slots in enumerate(rows.pair_index):
        for slot, index in enumerate(slots):
            if index < 0:
                continue
            sides = []
            for side in (1, 2):
                where = rows.segments[row] == 2 * slot + side
                tokens = rows.tokens[row][where].tolist()
                first = int(np.argmax(rows.loss_mask[row][where] > 0))
                sides.append((tokens[:first], tokens[first:]))
            out[int(index)] = EncodedPair(sides[0][0], sides[0][1], sides[1][1])
    return out
