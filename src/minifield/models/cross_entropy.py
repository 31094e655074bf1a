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

FP32 on a TPU (:func:`log_softmax`): the chip's float32 ``log`` is far from FP32's (JAX's
accuracy table, docs.jax.dev/en/latest/accuracy.html: up to 4030.5 ULP on TPU v2-v5e, where the
CPU's is 1.5; on a v5e log p was 5.8e-5 off where the sum was 2.83, docs/tpu.md) and its
default ``exp`` up to 116 ULP; so there the softmax's exponentials ask for ``exp``'s highest
accuracy (1.5 ULP) and the log of their sum is refined by one Newton step through it.
Elsewhere the softmax is ``jax.nn.log_softmax``'s, whose bits the CPU's recorded runs hold.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax


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

    # Inside lax.map's loop the recomputation cannot be merged with the forward, so the
    # barrier prevent_cse would add only stops XLA hoisting the head weight's BF16 rounding
    # out of the backward loop (once a step, not once a chunk: docs/tpu.md)
    @functools.partial(jax.checkpoint, prevent_cse=False)
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
    logp_XxV = log_softmax(logits_XxV)
    picked_X = jnp.take_along_axis(logp_XxV, targets_X[..., None], axis=-1)[..., 0]
    if not entropy:
        return picked_X, None
    p_XxV = accurate_exp(logp_XxV)
    # a token of probability 0 (a logit of −inf: a masked vocabulary entry) adds 0, not 0·(−inf)
    return picked_X, -jnp.where(p_XxV > 0, p_XxV * logp_XxV, 0.0).sum(axis=-1)


def accurate_exp(x):
    """``exp`` at its highest accuracy: 1.5 ULP on a TPU, where the default is up to 116 (JAX's
    accuracy table); a backend with one implementation (the CPU) computes the same bits."""
    return lax.exp(x, accuracy=lax.AccuracyMode.HIGHEST)


def log_softmax(logits_XxV):
    """``log softmax`` over the last axis, FP32 on every backend: on a TPU
    :func:`fp32_log_softmax`, elsewhere ``jax.nn.log_softmax`` (the same mathematics; the
    CPU's bits as recorded)."""
    if jax.default_backend() == "tpu":
        return fp32_log_softmax(logits_XxV)
    return jax.nn.log_softmax(logits_XxV, axis=-1)


def fp32_log_softmax(logits_XxV):
    """``jax.nn.log_softmax``'s steps (the maximum subtracted, the log of the exponentials'
    sum) with :func:`accurate_exp` and the sum's log refined (:func:`refine_log`), so a
    backend whose ``log`` and default ``exp`` are not FP32-accurate computes it within FP32's
    rounding."""
    max_Xx1 = jnp.max(logits_XxV, axis=-1, keepdims=True, initial=-jnp.inf)
    shifted_XxV = logits_XxV - lax.stop_gradient(max_Xx1)
    sum_Xx1 = jnp.sum(accurate_exp(shifted_XxV), axis=-1, keepdims=True)
    return shifted_XxV - refine_log(sum_Xx1, jnp.log(sum_Xx1))


def refine_log(s, log_s):
    """``log s`` from an approximation ``log_s`` with error ``e``: one Newton step for
    ``exp(y) = s``, ``y + s exp(-y) - 1``, leaves ``e^2 / 2`` plus :func:`accurate_exp`'s
    rounding (``s exp(-y)`` is within ``e`` of 1, so the ``- 1`` is exact). The step carries
    no gradient: ``d log s / d s = 1 / s`` is the approximation's own."""
    # the barrier keeps a compiler from folding exp(-log s) into 1 / s, which would undo the step
    y = lax.optimization_barrier(log_s)
    return log_s + lax.stop_gradient(s * accurate_exp(-y) - 1.0)
