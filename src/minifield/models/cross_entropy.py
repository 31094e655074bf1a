"""Next-token cross-entropy in token chunks, so ``[B, T, V]`` FP32 logits never exist at once.

With ``training.loss_chunk_tokens: C`` the final hidden states ``[B, T, D]`` are flattened to
``B*T`` tokens (padded to a whole number of chunks with zero states and target 0, whose losses
are dropped) and walked by ``lax.map`` in chunks of ``C`` tokens: each chunk forms its
``[C, V]`` FP32 logits, their log-softmax and the target's loss. The chunk body is
rematerialised (``jax.checkpoint``), so the backward pass recomputes a chunk's logits
instead of keeping them: peak logits memory is ``C x V x 4`` bytes forward and backward.
The head's weight gradient is accumulated over the chunks in FP32.

The mathematics is that of :func:`.model.token_losses`; the bits may differ (the head's
matrix product and its weight gradient are summed in another order).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp


def chunked_token_losses(head: Callable, h_BxTxD, targets_BxT, chunk_tokens: int):
    """``[B, T]`` FP32 losses -log softmax(head(h))[target], ``chunk_tokens`` tokens at a time.

    ``head`` maps hidden states ``[1, C, D]`` to FP32 logits ``[1, C, V]`` (final norm and
    output projection)."""
    B, T, D = h_BxTxD.shape
    N = B * T
    C = min(chunk_tokens, N)
    n_chunks = -(-N // C)
    pad = n_chunks * C - N
    h_NxD = jnp.pad(h_BxTxD.reshape(N, D), ((0, pad), (0, 0)))
    t_N = jnp.pad(targets_BxT.reshape(N), (0, pad))

    @jax.checkpoint
    def chunk_losses(h_CxD, t_C):
        logits_CxV = head(h_CxD[None])[0]
        logp_CxV = jax.nn.log_softmax(logits_CxV, axis=-1)
        return -jnp.take_along_axis(logp_CxV, t_C[:, None], axis=-1)[:, 0]

    losses = jax.lax.map(
        lambda xs: chunk_losses(*xs), (h_NxD.reshape(n_chunks, C, D), t_N.reshape(n_chunks, C))
    )
    return losses.reshape(n_chunks * C)[:N].reshape(B, T)
