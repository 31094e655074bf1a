"""The one log-softmax of the language-model losses (:func:`target_logps`), whole and in token
chunks, against float64 NumPy written from the definitions: ``log p(target)`` with
``p = softmax(h W)`` and the entropy ``H = −Σ_v p_v log p_v`` (a token of probability 0 adds 0,
the limit of ``p log p``). Each within FP32's rounding, on every backend: the TPU's path
(``cross_entropy.fp32_log_softmax``: its ``log`` refined, its ``exp`` at the highest accuracy)
is checked on CPU too, by making the code see a TPU (``tpu_path``)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from minifield.models import cross_entropy
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


@pytest.fixture(params=[False, True], ids=["backends-path", "tpu-path"])
def tpu_path(request, monkeypatch):
    """Whether the code under test takes the TPU's log-softmax (the backend seen as a TPU)."""
    if request.param:
        monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
    return request.param


@pytest.mark.parametrize("chunk", [0, 5, 100])
def test_target_logps_and_entropy_by_hand(chunk, tpu_path):
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


def test_uniform_logits_have_entropy_log_v(tpu_path):
    logp, entropy = target_logps(lambda h: jnp.zeros((*h.shape[:2], V)), H, TARGETS, entropy=True)
    np.testing.assert_allclose(np.asarray(entropy), math.log(V), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(logp), -math.log(V), rtol=1e-6)


@pytest.mark.parametrize("error", [0.0, 5.8e-5, -5e-4, 2e-3])
def test_one_newton_step_makes_an_approximate_log_fp32(error):
    """``refine_log`` from a log off by ``error`` (the chip's: log p 5.8e-5 off on a v5e where
    the sum was 2.83; up to 4030.5 ULP in JAX's table) over sums from 1 to 2e5: within 1e-6 of
    float64's, about FP32's rounding of log 2e5 (ulp 9.5e-7), and ``error²/2`` above that. The
    gradient is log's own."""
    s = np.geomspace(1.0, 2e5, 20001).astype(np.float32)
    refined = cross_entropy.refine_log(jnp.asarray(s), jnp.log(jnp.asarray(s)) + error)
    want = np.log(s.astype(np.float64))
    assert np.abs(np.asarray(refined, np.float64) - want).max() <= 1e-6 + error**2 / 2
    # the very bits of log's own gradient (not against 1/s in float64: on TPU v2-v5e even
    # reciprocal is up to 198 ULP in JAX's accuracy table)
    grad = jax.grad(lambda s: cross_entropy.refine_log(s, jnp.log(s) + error).sum())(s)
    np.testing.assert_array_equal(
        np.asarray(grad), np.asarray(jax.grad(lambda s: jnp.log(s).sum())(s))
    )


@pytest.mark.parametrize("chunk", [0, 5])
def test_the_gradient_is_the_softmax_one(chunk, tpu_path):
    """d Σ log p(target) / d h = (onehot(target) − p) Wᵀ, by hand; chunked as whole."""
    grad = jax.grad(lambda h: target_logps(head, h, TARGETS, chunk)[0].sum())(jnp.asarray(H))
    logits = H.astype(np.float64) @ W.astype(np.float64) + MASKED
    p = np.exp(logits - np.log(np.exp(logits).sum(-1, keepdims=True)))
    onehot = np.eye(V)[TARGETS]
    np.testing.assert_allclose(np.asarray(grad), (onehot - p) @ W.T, rtol=1e-5, atol=1e-6)
