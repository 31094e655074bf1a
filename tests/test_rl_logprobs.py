"""grpo's per-token log-probabilities honour ``training.loss_chunk_tokens``: in chunks they are
the whole batch's within FP32 rounding (the log-probabilities, the entropy and the gradient),
and the lowered gradient program never holds the ``[N, S − 1, V]`` FP32 logits. The values
themselves against a float64 log-softmax: tests/test_rl_rollouts.py and tests/test_cross_entropy.py."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest
from test_generation_cache import tiny

from minifield.models import llama
from minifield.models.execution import Execution
from minifield.rl import logprobs

TOKENS = np.asarray(
    [[3, 9, 14, 2, 0, 0, 0], [5, 5, 6, 7, 8, 1, 4], [1, 2, 3, 4, 5, 6, 7]], np.int32
)
MASK = (TOKENS > 0).astype(np.float32)


def chunked(cfg, tokens: int):
    return dataclasses.replace(cfg, execution=Execution(loss_chunk_tokens=tokens))


def value_and_grad(cfg):
    def objective(params):
        logps, entropy = logprobs.token_logps(params, cfg, TOKENS, 0.8)
        return (logps * MASK).sum(), (logps, entropy)

    return jax.value_and_grad(objective, has_aux=True)


@pytest.mark.slow  # compile-heavy for the fast tier (two gradient programs of a model)
def test_chunked_log_probabilities_are_the_whole_batchs():
    cfg, params = tiny(seed=2)
    (_, (logps, entropy)), grads = jax.jit(value_and_grad(cfg))(params)
    # 3 rows of 6 scored slots: 18 tokens, chunks of 5 (the last padded)
    (_, (logps_c, entropy_c)), grads_c = jax.jit(value_and_grad(chunked(cfg, 5)))(params)
    np.testing.assert_allclose(np.asarray(logps_c), np.asarray(logps), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(entropy_c), np.asarray(entropy), rtol=1e-5, atol=1e-5)
    for whole, part in zip(jax.tree.leaves(grads), jax.tree.leaves(grads_c), strict=True):
        scale = float(np.abs(np.asarray(whole)).max()) or 1.0
        np.testing.assert_allclose(np.asarray(part), np.asarray(whole), atol=1e-5 * scale)


def test_chunked_log_probabilities_never_form_the_whole_batch_of_logits():
    """Lowered, not compiled: the vocabulary is 67, the scored slots 3 × 6."""
    cfg = llama.LlamaConfig(
        vocab_size=67, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=48, max_len=40
    )
    params = jax.eval_shape(lambda: llama.init_params(cfg, jax.random.key(0)))

    def lowered(c):
        return jax.jit(value_and_grad(c)).lower(params).as_text()

    assert "tensor<3x6x67xf32>" in lowered(cfg)
    text = lowered(chunked(cfg, 4))
    assert "tensor<3x6x67xf32>" not in text and "tensor<18x67xf32>" not in text
    assert "tensor<4x67xf32>" in text
