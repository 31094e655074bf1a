"""Per-answer log-probabilities of packed pair rows: one forward, summed per segment.

The forward is packed-sft's (:func:`minifield.models.model.token_losses`: block-diagonal causal
attention over segments, positions restarting per segment, chunked cross-entropy when the
recipe asks), so a pair packed with others sees exactly what it would see alone. A target
counts where :func:`minifield.models.model.loss_weights` says (an answer token of the same
segment); its log-probability is summed into its segment with ``jax.ops.segment_sum``. Pair
slot ``k`` of a row reads segment ``2k + 1`` (chosen) and ``2k + 2`` (rejected), as
:mod:`.pairs` packs them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ...models.model import loss_weights, token_losses
from .pairs import PairRows


def segment_sums(values_BxT, batch: PairRows, width: int):
    """``[B, 2 * width]``: the sum of ``values`` over each segment's counted targets."""
    B, T = values_BxT.shape
    S = 2 * width
    w_BxT = loss_weights(batch)
    # a counted target's segment is that of its slot (loss_weights requires them equal)
    ids_BxT = jnp.arange(B, dtype=jnp.int32)[:, None] * S + jnp.maximum(batch.segments - 1, 0)
    sums = jax.ops.segment_sum((values_BxT * w_BxT).reshape(-1), ids_BxT.reshape(-1), B * S)
    counts = jax.ops.segment_sum(w_BxT.reshape(-1), ids_BxT.reshape(-1), B * S)
    return sums.reshape(B, S), counts.reshape(B, S)


def answer_logps(params, cfg, batch: PairRows) -> dict:
    """Per pair slot ``[B, M]`` (``M`` = ``batch.pair_index``'s width): the summed
    log-probabilities of the chosen and rejected answers (``chosen``, ``rejected``), their
    token counts (``chosen_len``, ``rejected_len``) and ``valid`` (1 where the slot holds a
    pair)."""
    width = batch.pair_index.shape[1]
    logp_BxT = -token_losses(params, cfg, batch)
    sums, counts = segment_sums(logp_BxT, batch, width)
    return {
        "chosen": sums[:, 0::2],
        "rejected": sums[:, 1::2],
        "chosen_len": counts[:, 0::2],
        "rejected_len": counts[:, 1::2],
        "valid": (batch.pair_index >= 0).astype(jnp.float32),
    }


#: the per-pair values :func:`by_pair` gathers
PAIR_VALUES = ("chosen", "rejected", "chosen_len", "rejected_len")


def padded(rows: PairRows, n: int) -> PairRows:
    """``rows`` with empty rows appended up to ``n`` (no segment, no pair), so every batch of
    an evaluation has one shape (one compilation)."""
    import numpy as np

    extra = n - rows.tokens.shape[0]
    if extra <= 0:
        return rows

    def grown(name, v):
        fill = -1 if name == "pair_index" else 0
        return np.concatenate([v, np.full((extra, *v.shape[1:]), fill, v.dtype)])

    return rows._make(
        None if v is None else grown(name, v) for name, v in zip(rows._fields, rows, strict=True)
    )


def by_pair(logps_fn, rows: PairRows, batch_size: int, n_pairs: int) -> dict:
    """Per pair of the file (``[n_pairs]`` float32, NaN for a pair not packed): the values of
    :data:`PAIR_VALUES` that ``logps_fn(batch)`` (:func:`answer_logps` bound to parameters)
    gives for the packed ``rows``, ``batch_size`` rows at a time."""
    import numpy as np

    out = {k: np.full(n_pairs, np.nan, np.float32) for k in PAIR_VALUES}
    for start in range(0, rows.tokens.shape[0], batch_size):
        chunk = rows._make(None if v is None else v[start : start + batch_size] for v in rows)
        chunk = padded(chunk, batch_size)
        values = logps_fn(chunk)
        index = np.asarray(chunk.pair_index)
        held = index >= 0
        for key in PAIR_VALUES:
            out[key][index[held]] = np.asarray(values[key])[held]
    return out
