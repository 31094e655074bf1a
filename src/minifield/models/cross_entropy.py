"""Target log-probabilities (and the entropy) of next-token logits, whole or in token chunks.

:func:`target_logps` is the one place the language-model losses read ``log softmax(logits)``:
packed-sft's cross-entropy (:func:`.model.token_losses`, hence preference's answer
log-probabilities) and grpo's per-token log-probabilities (:mod:`minifield.rl.logprobs`).

With ``training.loss_chunk_tokens: C`` the final hidden states ``[B, T, D]`` are flattened to
``B*T`` tokens (padded to a whole number of chunks with zero states and target 0, whose values
are dropped) and walked by ``lax.map`` in chunks of ``C`` tokens: each chunk forms its
``[C, V]`` FP32 logits, their log-softmax and the target's log-probability. The chunk body is
rematerialised (``jax.checkpoint``), so the backward pass recomputes a chunk's logits
instead of keeping them: peak logits memory is ``C x V x 4`` bytes forward and backward.
The head's weight gradient is accumulated over the chunks in FP32.

Chunked and whole compute the same mathematics; the bits may differ (the head's matrix product
and its weight gradient are summed in another order), which is why the key is part of the
computation digest.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp


def target_logps(
    head: Callable, h_BxTxD, targets_BxT, chunk_tokens: int = 0, *, entropy: bool = False
):
    """``(logp_BxT, entropy_BxT)``, FP32: ``log softmax(head(h))[target]`` per slot and, with
    ``entropy``, the entropy of ``softmax(head(h))`` (else None).

    ``head`` maps hidden states ``[b, t, D]`` to the FP32 logits ``[b, t, V]`` the
    probabilities are the softmax of (final norm, output projection and, for a sampling
    policy, the division by its temperature). ``chunk_tokens`` 0 forms every logit at once;
    ``C > 0`` forms ``C`` tokens' at a time (see the module)."""
    if not chunk_tokens:
        return _from_logits(head(h_BxTxD), targets_BxT, entropy)
    B, T, D = h_BxTxD.shape
    N = B * T
    C = min(chunk_tokens, N)
    n_chunks = -(-N // C)
    pad = n_chunks * C - N
    h_NxD = jnp.pad(h_BxTxD.reshape(N, D), ((0, pad), (0, 0)))
    t_N = jnp.pad(targets_BxT.reshape(N), (0, pad))

    @jax.checkpoint
    def chunk(h_CxD, t_C):
        return _from_logits(head(h_CxD[None])[0], t_C, entropy)

    logp_K, entropy_K = jax.lax.map(
        lambda xs: chunk(*xs), (h_NxD.reshape(n_chunks, C, D), t_N.reshape(n_chunks, C))
    )

    def unchunked(values):
        return values.reshape(n_chunks * C)[:N].reshape(B, T)

    return unchunked(logp_K), None if entropy_K is None else unchunked(entropy_K)


def _from_logits(logits_XxV, targets_X, entropy: bool):
    """The target's log-probability (and the entropy) over the last axis of ``logits``."""
    logp_XxV = jax.nn.log_softmax(logits_XxV, axis=-1)
    picked_X = jnp.take_along_axis(logp_XxV, targets_X[..., None], axis=-1)[..., 0]
    if not entropy:
        return picked_X, None
    p_XxV = jnp.exp(logp_XxV)
    # a token of probability 0 (a logit of −inf: a masked vocabulary entry) adds 0, not 0·(−inf)
    return picked_X, -jnp.where(p_XxV > 0, p_XxV * logp_XxV, 0.0).sum(axis=-1)
