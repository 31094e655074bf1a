"""The one log-softmax of the language-model losses (:func:`target_logps`), whole and in token
chunks, against float64 NumPy written from the definitions: ``log p(target)`` with
``p = softmax(h W)`` and the entropy ``H = −Σ_v p_v log p_v`` (a token of probability 0 adds 0,
the limit of ``p log p``)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from minifield.models.cross_entropy import target_logps

B, T, D, V = 2, 6, 3, 7
RNG = np.random.default_rng(0)
H = RNG.normal(size=(B, T, D)).astype(np.float32)
W = RNG.normal(size=(D, V)).astype(np.float32)
TARGETS = RNG.integers(0, V, (B, T)).astype(np.int32)
#: vocabulary entry 3 masked out (a logit of −inf): its probability is 0 everywhere
MASKED = np.where(np.arange(V) == 3, -np.inf, 0.0).astype(np.float32)


def head(h_BxTxD):
    # FP32 as the model's head multiplies (HIGHEST; a TPU's default is one BF16 pass)
    return jnp.einsum("btd,dv->btv", h_BxTxD, W, precision=jax.lax.Precision.HIGHEST) + MASKED


def by_hand():
    """(log p(target), entropy) per slot in float64."""
    logits = H.astype(np.float64) @ W.astype(np.float64) + MASKED
    log_z = np.log(np.exp(logits).sum(-1, keepdims=True))
    logp = logits - log_z
    p = np.exp(logp)
    entropy = -np.where(p > 0, p * np.where(p > 0, logp, 0.0), 0.0).sum(-1)
    return np.take_along_axis(logp, TARGETS[..., None], -1)[..., 0], entropy


@pytest.mark.parametrize("chunk", [0, 5, 100])
def test_target_logps_and_entropy_by_hand(chunk):
    """Whole (0) and in chunks: 5 leaves the last of B·T = 12 tokens' chunks padded, 100 is
    one chunk of all 12."""
    want_logp, want_entropy = by_hand()
    logp, entropy = target_logps(head, H, TARGETS, chunk, entropy=True)
    assert logp.shape == entropy.shape == (B, T) and logp.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(logp), want_logp, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(entropy), want_entropy, rtol=1e-5, atol=1e-6)
    assert np.isfinite(np.asarray(entropy)).all()  # the −inf logit: 0, not 0·(−inf) = NaN
    alone, none = target_logps(head, H, TARGETS, chunk)
    assert none is None
    np.testing.assert_array_equal(np.asarray(alone), np.asarray(logp))


def test_uniform_logits_have_entropy_log_v():
    logp, entropy = target_logps(lambda h: jnp.zeros((*h.shape[:2], V)), H, TARGETS, entropy=True)
    np.testing.assert_allclose(np.asarray(entropy), math.log(V), rtol=1e-6)
    # the chip's log: 1.01e-6 relative on a TPU v5e (docs/tpu.md#tests-on-the-chip)
    rtol = 1e-5 if jax.default_backend() == "tpu" else 1e-6
    np.testing.assert_allclose(np.asarray(logp), -math.log(V), rtol=rtol)


@pytest.mark.parametrize("chunk", [0, 5])
def test_the_gradient_is_the_softmax_one(chunk):
    """d Σ log p(target) / d h = (onehot(target) − p) Wᵀ, by hand; chunked as whole."""
    grad = jax.grad(lambda h: target_logps(head, h, TARGETS, chunk)[0].sum())(jnp.asarray(H))
    logits = H.astype(np.float64) @ W.astype(np.float64) + MASKED
    p = np.exp(logits - np.log(np.exp(logits).sum(-1, keepdims=True)))
    onehot = np.eye(V)[TARGETS]
    np.testing.assert_allclose(np.asarray(grad), (onehot - p) @ W.T, rtol=1e-5, atol=1e-6)
