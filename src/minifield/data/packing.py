"""Packing encoded examples into fixed-length rows (first-fit decreasing).

Each row of ``seq_len`` slots holds whole examples one after another:

- ``tokens``    token ids, ``pad`` in unused slots
- ``segments``  1, 2, ... per example within the row, 0 for padding; attention
  is causal *and* restricted to equal segment ids, so examples never see each other
- ``positions`` 0, 1, ... restarting at every example (0 on padding)
- ``loss_mask`` 1.0 on the slots holding trained response tokens (including ``<eos>``,
  every assistant turn's end-of-turn token in a conversation), 0.0 on prompt, ``<bos>``,
  ``<sep>``, a conversation's user and tool turns and padding: a slot's flag says whether
  the token *in* it is trained on (it is predicted from the slot before it)

Examples longer than a row are truncated (their tail cut at ``seq_len``) or
rejected, as the recipe says; both are counted. An example whose prompt alone
fills the row keeps no response token and is always rejected.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from .encoding import Encoded

OVERLONG = ("truncate", "reject")


class Rows(NamedTuple):
    """Packed rows ``[B, T]`` (the module docstring): what :func:`pack` builds, what an update
    of the language-model loss receives (:func:`minifield.models.model.loss_fn`) and what its
    evaluation reads. A JAX pytree with fixed fields: its shapes, not its keys, make the
    compiled program. Prepared examples store field ``f`` of split ``s`` as ``{s}_{f}``."""

    tokens: Any  # int32
    segments: Any  # int32, 0 on padding
    positions: Any  # int32
    loss_mask: Any  # float32 (0/1)

    @classmethod
    def of(cls, arrays, prefix: str) -> Rows:
        """The rows prepared arrays hold under ``{prefix}_{field}``."""
        return cls(*(arrays[f"{prefix}_{name}"] for name in cls._fields))

    def named(self, prefix: str) -> dict[str, np.ndarray]:
        """The rows as prepared arrays, ``{prefix}_{field}``."""
        return {f"{prefix}_{name}": value for name, value in zip(self._fields, self, strict=True)}

    def take(self, index) -> Rows:
        """Rows ``index`` of every field, as NumPy arrays."""
        return self._make(np.asarray(value[index]) for value in self)


#: the arrays of a packed row (a batch is these, rows stacked)
ROW_FIELDS = Rows._fields


@dataclass(frozen=True)
class Packed:
    rows: Rows
    stats: dict


def first_fit_decreasing(lengths: list[int], capacity: int) -> list[list[int]]:
    """Bins (lists of item indices) by first-fit decreasing; ties keep input order (deterministic).

    Items are placed longest first, each into the first row that still has room.
    Within a row, items keep their placement order.
    """
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    remaining = np.zeros(0, dtype=np.int64)
    bins: list[list[int]] = []
    for index in order:
        size = lengths[index]
        if size > capacity:
            raise ValueError(f"item {index} of length {size} exceeds the capacity {capacity}")
        fits = np.flatnonzero(remaining >= size)
        if fits.size:
            target = int(fits[0])
        else:
            target = len(bins)
            bins.append([])
            remaining = np.append(remaining, capacity)
        bins[target].append(index)
        remaining[target] -= size
    return bins


def fit(example: Encoded, seq_len: int, overlong: str) -> tuple[Encoded | None, str]:
    """(example or None, "kept" | "truncated" | "rejected") for a row of ``seq_len``."""
    if overlong not in OVERLONG:
        raise ValueError(f"overlong must be one of {OVERLONG}, got {overlong!r}")
    if len(example) <= seq_len:
        return example, "kept"
    if overlong == "reject" or len(example.prompt) >= seq_len:
        return None, "rejected"
    return example.cut(seq_len - len(example.prompt)), "truncated"


def pack(examples: list[Encoded], seq_len: int, overlong: str, pad_id: int) -> Packed:
    """Pack ``examples`` into rows; ``stats`` counts kept/truncated/rejected and the efficiency."""
    kept, counts = [], {"kept": 0, "truncated": 0, "rejected": 0}
    for example in examples:
        fitted, outcome = fit(example, seq_len, overlong)
        counts[outcome] += 1
        if fitted is not None:
            kept.append(fitted)
    bins = first_fit_decreasing([len(e) for e in kept], seq_len)
    rows = len(bins)
    tokens = np.full((rows, seq_len), pad_id, dtype=np.int32)
    segments = np.zeros((rows, seq_len), dtype=np.int32)
    positions = np.zeros((rows, seq_len), dtype=np.int32)
    loss_mask = np.zeros((rows, seq_len), dtype=np.float32)
    for row, members in enumerate(bins):
        offset = 0
        for segment, index in enumerate(members, start=1):
            example = kept[index]
            n_prompt, n = len(example.prompt), len(example)
            tokens[row, offset : offset + n] = example.tokens
            segments[row, offset : offset + n] = segment
            positions[row, offset : offset + n] = np.arange(n)
            loss_mask[row, offset + n_prompt : offset + n] = example.response_mask()
            offset += n
    real = int(sum(len(e) for e in kept))
    slots = rows * seq_len
    stats = {
        "examples": len(examples),
        "packed": len(kept),
        "kept": counts["kept"],
        "truncated": counts["truncated"],
        "rejected": counts["rejected"],
        "rows": rows,
        "seq_len": seq_len,
        "real_tokens": real,
        "loss_tokens": int(loss_mask.sum()),
        "slots": slots,
        "efficiency": real / slots if slots else 0.0,
    }
    return Packed(Rows(tokens, segments, positions, loss_mask), stats)


def prompts_and_answers(examples: list[Encoded], pad_id: int) -> dict[str, np.ndarray]:
    """Padded prompt and expected-response arrays for exact-match evaluation by generation.

    ``answers`` holds the response tokens *including* ``<eos>``; generation is
    exact when it reproduces ``answers[i, :answer_len[i]]``.
    """
    n = len(examples)
    prompt_max = max((len(e.prompt) for e in examples), default=1)
    answer_max = max((len(e.response) for e in examples), default=1)
    prompts = np.full((n, prompt_max), pad_id, dtype=np.int32)
    answers = np.full((n, answer_max), pad_id, dtype=np.int32)
    prompt_len = np.zeros(n, dtype=np.int32)
    answer_len = np.zeros(n, dtype=np.int32)
    for i, example in enumerate(examples):
        prompts[i, : len(example.prompt)] = example.prompt
        answers[i, : len(example.response)] = example.response
        prompt_len[i] = len(example.prompt)
        answer_len[i] = len(example.response)
    return {
        "prompts": prompts,
        "prompt_len": prompt_len,
        "answers": answers,
        "answer_len": answer_len,
    }


def concatenate(sources: dict[str, Packed]) -> tuple[Packed, dict[str, dict]]:
    """The rows of several separately packed sources, one source after another (each
    source's row count is its ``stats["rows"]``); the combined stats, and each source's
    own."""
    parts = [p.rows for p in sources.values()]
    rows = Rows._make(np.concatenate(field) for field in zip(*parts, strict=True))
    summed = ("examples", "packed", "kept", "truncated", "rejected", "rows")
    stats = {k: sum(p.stats[k] for p in sources.values()) for k in summed}
    stats["seq_len"] = next(iter(sources.values())).stats["seq_len"]
    for key in ("real_tokens", "loss_tokens", "slots"):
        stats[key] = sum(p.stats[key] for p in sources.values())
    stats["efficiency"] = stats["real_tokens"] / stats["slots"] if stats["slots"] else 0.0
    return Packed(rows, stats), {name: p.stats for name, p in sources.items()}
