"""An update's rollouts as the device batch, and as the JSON lines file kept in the attempt.

The batch (:func:`batch_of`, a :class:`Batch`): row ``n`` holds completion ``n`` after its prompt from slot 0
(``tokens [N, S]``, padding 0 after it), ``mask`` 1 on its completion tokens (0 for all of a
truncated completion's with ``rl.mask_truncated_completions``), each token's ``weights`` in the
loss (:func:`minifield.rl.advantages.token_weights` of the loss type; bnpo's over the update's
``training.grad_accum_steps`` micro-batches) and the ``advantages``.

The file, ``rollouts/update-{n:08d}.jsonl`` in the attempt directory (written whole, then
renamed into place): one line per completion, in row order::

    {"update": n, "row": i, "prompt_index": p, "completion_index": c,
     "prompt_ids": [...], "completion_ids": [...], "completion": "text",
     "rewards": {name: value, ...}, "total": r, "advantage": a, "truncated": bool,
     "logps": [...], "ref_logps": [...]}

``logps`` are the rollout policy's log-probabilities of the completion's tokens (iteration 1's
forward, what its ratio is taken against), ``ref_logps`` the reference's (only with
``beta`` > 0), both as the float32 values the update used. From a file alone the rewards can
be recomputed (the completion and its prompt row), and so can the update's first-iteration
loss: advantages from the totals, token weights from the completion lengths, the k3 KL from
the two log-probabilities (docs/grpo.md "The rollouts file").
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from ... import atomic
from ...rl import advantages as group_advantages

DIRECTORY = "rollouts"


class Batch(NamedTuple):
    """What one grpo update receives (a JAX pytree: a field left None holds no array)."""

    tokens: Any  # [N, S] int32: prompt then completion
    mask: Any  # [N, S] float32: 1 on completion tokens that count
    weights: Any  # [N, S] float32: each token's share of the loss
    advantages: Any  # [N] float32
    ref_logps: Any = None  # [N, S] float32, the reference's (beta > 0), on the device


def file_name(update: int) -> str:
    return f"update-{update:08d}.jsonl"


def export_name(input_name: str) -> str:
    """The name a Python reward's pinned file has inside an export."""
    return f"reward-{input_name}"


def completion_mask(made, rl: dict, seq_len: int) -> np.ndarray:
    mask = np.zeros((len(made.completion_ids), seq_len), np.float32)
    for row, (prompt, completion) in enumerate(
        zip(made.prompt_ids, made.completion_ids, strict=True)
    ):
        if rl["mask_truncated_completions"] and made.truncated[row]:
            continue
        mask[row, len(prompt) : len(prompt) + len(completion)] = 1.0
    return mask


def batch_of(made, advantages: np.ndarray, rl: dict, seq_len: int, micro_batches: int = 1) -> Batch:
    N = len(made.completion_ids)
    tokens = np.zeros((N, seq_len), np.int32)
    for row, (prompt, completion) in enumerate(
        zip(made.prompt_ids, made.completion_ids, strict=True)
    ):
        ids = prompt + completion
        tokens[row, : len(ids)] = ids
    mask = completion_mask(made, rl, seq_len)
    weights = group_advantages.token_weights(
        rl["loss_type"], mask, rl["max_completion_length"], micro_batches
    )
    return Batch(tokens, mask, np.asarray(weights, np.float32), np.asarray(advantages, np.float32))


def _floats(values: np.ndarray) -> list[float]:
    # a float32 printed as the shortest decimal of its float64 value reads back exactly
    return [float(v) for v in np.asarray(values, np.float32)]


def lines(update: int, made, scored, advantages, logps, ref_logps) -> list[dict]:
    out = []
    for row, (prompt, completion) in enumerate(
        zip(made.prompt_ids, made.completion_ids, strict=True)
    ):
        span = slice(len(prompt), len(prompt) + len(completion))
        line = {
            "update": update,
            "row": row,
            "prompt_index": int(made.prompt_index[row]),
            "completion_index": int(made.completion_index[row]),
            "prompt_ids": list(prompt),
            "completion_ids": list(completion),
            "completion": scored.texts[row],
            "rewards": {name: float(v[row]) for name, v in scored.values.items()},
            "total": float(scored.total[row]),
            "advantage": float(np.float32(advantages[row])),
            "truncated": bool(made.truncated[row]),
            "logps": _floats(logps[row, span]),
        }
        if ref_logps is not None:
            line["ref_logps"] = _floats(ref_logps[row, span])
        out.append(line)
    return out


def write(directory: Path, update: int, made, scored, advantages, logps, ref_logps) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    text = "".join(
        json.dumps(line, ensure_ascii=False, sort_keys=True) + "\n"
        for line in lines(update, made, scored, advantages, logps, ref_logps)
    )
    path = directory / file_name(update)
    atomic.write_bytes(path, text.encode("utf-8"))
    return path


def read(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text(encoding="utf-8").splitlines()]
