"""The router's load-balancing loss against a NumPy transcription of transformers'
``load_balancing_loss_func`` (``modeling_qwen2_moe.py``, copied into Mixtral's and OLMoE's):
the layers' logits concatenated, softmax, top-k one-hot, means over tokens (over the
attention mask's tokens when given), ``sum(tokens_per_expert * router_prob) * num_experts``."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from test_moe_families import QWEN3_MOE

from minifield.hf import config as hf_config
from minifield.models import moe


def reference(gate_logits: list[np.ndarray], num_experts: int, top_k: int, attention_mask=None):
    """transformers' function, line by line, in float64 (gate_logits: per layer [B*T, E])."""
    concatenated = np.concatenate(gate_logits, axis=0).astype(np.float64)
    routing = np.exp(concatenated - concatenated.max(-1, keepdims=True))
    routing /= routing.sum(-1, keepdims=True)
    selected = np.argsort(-routing, axis=-1, kind="stable")[:, :top_k]
    expert_mask = np.eye(num_experts)[selected]  # [L*B*T, k, E]
    if attention_mask is None:
        tokens_per_expert = expert_mask.mean(0)
        router_prob_per_expert = routing.mean(0)
    else:
        b, s = attention_mask.shape
        layers = concatenated.shape[0] // (b * s)
        m = np.broadcast_to(
            attention_mask[None, :, :, None, None], (layers, b, s, top_k, num_experts)
        )
        m = m.reshape(-1, top_k, num_experts)
        tokens_per_expert = (expert_mask * m).sum(0) / m.sum(0)
        r = np.broadcast_to(attention_mask[None, :, :, None], (layers, b, s, num_experts))
        r = r.reshape(-1, num_experts)
        router_prob_per_expert = (routing * r).sum(0) / r.sum(0)
    return float((tokens_per_expert * router_prob_per_expert[None]).sum() * num_experts)


def test_the_loss_equals_transformers_formula_with_and_without_padding():
    cfg = hf_config.config_from_hf(QWEN3_MOE, max_len=32)  # 5 experts, top 3
    rng = np.random.default_rng(0)
    B, T, L, E = 2, 7, 2, cfg.n_experts
    logits = rng.standard_normal((L, B * T, E)).astype(np.float32) * 2
    expected = reference(list(logits), E, cfg.experts_per_token)
    ours = float(moe.load_balancing_loss(cfg, jnp.asarray(logits)))
    np.testing.assert_allclose(ours, expected, rtol=1e-5)
    mask = (np.arange(T)[None, :] < np.array([[7], [4]])).astype(np.float32)  # row 2 padded
    expected_masked = reference(list(logits), E, cfg.experts_per_token, mask)
    ours_masked = float(
        moe.load_balancing_loss(cfg, jnp.asarray(logits), jnp.asarray(mask.reshape(-1)))
    )
    np.testing.assert_allclose(ours_masked, expected_masked, rtol=1e-5)
    assert abs(expected_masked - expected) > 1e-4  # the padding counts
