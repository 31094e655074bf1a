"""Tiny checkpoints of each model family and an independent reference forward.

Random tensors under the HF names, written by hand here (not the project's name table), with
real ``config.json`` field names and scaled-down shapes. The reference is a float64 NumPy
forward written from transformers' PyTorch ``modeling_mistral.py``, ``modeling_qwen2.py``,
``modeling_qwen3.py``, ``modeling_phi3.py``, ``modeling_gemma.py``, ``modeling_gemma2.py``,
``modeling_gemma3.py``, ``modeling_rope_utils.py`` (longrope) and ``masking_utils.py``
(sliding window: key position ``> query position - sliding_window``), sharing no code with the
project.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

BASE = {
    "vocab_size": 61,
    "hidden_size": 32,
    "intermediate_size": 40,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "hidden_act": "silu",
}
MISTRAL = {
    **BASE,
    "architectures": ["MistralForCausalLM"],
    "model_type": "mistral",
    "sliding_window": 4,
    "rope_theta": 1000000.0,
}
QWEN2 = {
    **BASE,
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "tie_word_embeddings": True,
    # layer 0 full, layer 1 windowed (transformers: layers i >= max_window_layers slide)
    "use_sliding_window": True,
    "sliding_window": 5,
    "max_window_layers": 1,
}
QWEN3 = {
    **BASE,
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "head_dim": 12,  # 4 heads x 12 = 48 != hidden_size 32
    "attention_bias": False,
    "rope_theta": 1000000.0,
}
PHI3 = {
    **BASE,
    "architectures": ["Phi3ForCausalLM"],
    "model_type": "phi3",
    "sliding_window": 5,  # Phi-3-mini-4k: 2047 of 4096
    "original_max_position_embeddings": 64,
    "rms_norm_eps": 1e-5,
    "rope_scaling": None,
}
GEMMA = {
    **{k: v for k, v in BASE.items() if k not in ("tie_word_embeddings", "hidden_act")},
    "architectures": ["GemmaForCausalLM"],
    "model_type": "gemma",
    "num_key_value_heads": 1,  # gemma-2b: multi-query
    "head_dim": 16,  # gemma-7b: 16 heads x 256 > hidden_size 3072
    "hidden_act": "gelu_pytorch_tanh",
    "attention_bias": False,
}
GEMMA2 = {
    **{k: v for k, v in GEMMA.items() if k != "hidden_act"},
    "architectures": ["Gemma2ForCausalLM"],
    "model_type": "gemma2",
    "num_key_value_heads": 2,
    "hidden_activation": "gelu_pytorch_tanh",
    "query_pre_attn_scalar": 24,  # not head_dim 16
    "attn_logit_softcapping": 5.0,  # small enough to bend these scores
    "final_logit_softcapping": 3.0,
    "sliding_window": 4,  # layer_types absent: layer 0 sliding, layer 1 full
}
GEMMA3 = {
    **{k: v for k, v in GEMMA2.items() if "softcapping" not in k},
    "architectures": ["Gemma3ForCausalLM"],
    "model_type": "gemma3_text",
    "query_pre_attn_scalar": 20,
    "sliding_window_pattern": 2,  # layer 0 sliding (local rotary base), layer 1 full (global)
    "rope_theta": 1000000.0,
    "rope_local_base_freq": 100.0,
    "rope_scaling": {"rope_type": "linear", "factor": 2.0},  # the global layers' only
}
CONFIGS = {
    "mistral-window": MISTRAL,
    "qwen2-window-layer-1": QWEN2,
    "qwen3": QWEN3,
    "qwen3-window-tied": {
        **QWEN3,
        "tie_word_embeddings": True,
        "use_sliding_window": True,
        "sliding_window": 3,
        "layer_types": ["sliding_attention", "full_attention"],
    },
    "phi3-window": PHI3,
    # Phi-3.5 style: longrope with max_position_embeddings 4x original (attention factor 1.15)
    "phi3-longrope": {
        **PHI3,
        "max_position_embeddings": 256,
        "rope_scaling": {
            "type": "longrope",
            "short_factor": [1.0, 1.3, 2.5, 6.0],
            "long_factor": [1.5, 3.0, 9.0, 30.0],
        },
    },
    "gemma": GEMMA,  # tie_word_embeddings absent: tied, as transformers' GemmaConfig
    "gemma-exact-gelu-untied": {**GEMMA, "hidden_act": "gelu", "tie_word_embeddings": False},
    "gemma2": GEMMA2,
    "gemma3": GEMMA3,
}
ROWS = [[1, 5, 7, 9, 11, 13, 2, 60, 3, 3, 40, 17], [56, 0, 4, 8, 15, 16, 23, 42, 8, 1, 9, 30]]


def head_dim(hf: dict) -> int:
    default = 128 if hf["model_type"] == "qwen3" else hf["hidden_size"] // hf["num_attention_heads"]
    return hf.get("head_dim") or default


def hf_tensors(hf: dict, seed: int) -> dict[str, np.ndarray]:
    """Random FP32 tensors under HF's PyTorch names and ``[out, in]`` layouts, of any family
    (test_llama's Llama/Mistral/Qwen2 checkpoints too)."""
    rng = np.random.default_rng(seed)
    D, F, V = hf["hidden_size"], hf["intermediate_size"], hf["vocab_size"]
    H, G, K = hf["num_attention_heads"], hf["num_key_value_heads"], head_dim(hf)

    def w(*shape, scale=None):
        scale = shape[-1] ** -0.5 if scale is None else scale
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    t = {"model.embed_tokens.weight": w(V, D, scale=0.5), "model.norm.weight": 1 + w(D, scale=0.1)}
    for i in range(hf["num_hidden_layers"]):
        p = f"model.layers.{i}."
        t[p + "input_layernorm.weight"] = 1 + w(D, scale=0.1)
        t[p + "post_attention_layernorm.weight"] = 1 + w(D, scale=0.1)
        t[p + "self_attn.q_proj.weight"] = w(H * K, D)
        t[p + "self_attn.k_proj.weight"] = w(G * K, D)
        t[p + "self_attn.v_proj.weight"] = w(G * K, D)
        t[p + "self_attn.o_proj.weight"] = w(D, H * K)
        if hf["model_type"] == "qwen2":
            for n, rows in (("q", H * K), ("k", G * K), ("v", G * K)):
                t[p + f"self_attn.{n}_proj.bias"] = w(rows, scale=0.3)
        if hf["model_type"] in ("qwen3", "gemma3_text"):
            t[p + "self_attn.q_norm.weight"] = 1 + w(K, scale=0.2)
            t[p + "self_attn.k_norm.weight"] = 1 + w(K, scale=0.2)
        t[p + "mlp.gate_proj.weight"] = w(F, D)
        t[p + "mlp.up_proj.weight"] = w(F, D)
        t[p + "mlp.down_proj.weight"] = w(D, F)
        if hf["model_type"] == "phi3":  # one qkv_proj (rows q, k, v), one gate_up_proj
            qkv = [t.pop(p + f"self_attn.{n}_proj.weight") for n in "qkv"]
            t[p + "self_attn.qkv_proj.weight"] = np.concatenate(qkv)
            gate_up = [t.pop(p + f"mlp.{n}_proj.weight") for n in ("gate", "up")]
            t[p + "mlp.gate_up_proj.weight"] = np.concatenate(gate_up)
        if hf["model_type"] in ("gemma2", "gemma3_text"):  # four norms per layer
            t[p + "pre_feedforward_layernorm.weight"] = w(D, scale=0.3)
            t[p + "post_feedforward_layernorm.weight"] = w(D, scale=0.3)
    if not hf.get("tie_word_embeddings", hf["model_type"].startswith("gemma")):
        t["lm_head.weight"] = w(V, D)
    return t


def write_checkpoint(directory: Path, hf: dict, tensors: dict) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    (directory / "config.json").write_text(json.dumps(hf))
    return directory


def layer_windows(hf: dict) -> list[int | None]:
    """Per layer the sliding window transformers applies (None: full causal attention)."""
    L = hf["num_hidden_layers"]
    if hf["model_type"] in ("mistral", "phi3"):
        return [hf.get("sliding_window")] * L
    if hf["model_type"] in ("gemma2", "gemma3_text"):  # layer_types absent: (i + 1) % pattern
        pattern = hf.get("sliding_window_pattern", 2 if hf["model_type"] == "gemma2" else 6)
        return [hf["sliding_window"] if (i + 1) % pattern else None for i in range(L)]
    if not hf.get("use_sliding_window"):
        return [None] * L
    types = hf.get("layer_types") or [
        "sliding_attention" if i >= hf.get("max_window_layers", 28) else "full_attention"
        for i in range(L)
    ]
    return [hf["sliding_window"] if t == "sliding_attention" else None for t in types]


def reference_logits(t: dict, hf: dict, ids) -> np.ndarray:
    """One unpacked row through the family's forward, float64 NumPy from the equations."""
    t = {k: v.astype(np.float64) for k, v in t.items()}
    H, G, K = hf["num_attention_heads"], hf["num_key_value_heads"], head_dim(hf)
    eps, T = hf["rms_norm_eps"], len(ids)

    gemma = hf["model_type"].startswith("gemma")
    gemma2 = hf["model_type"] in ("gemma2", "gemma3_text")  # four norms per layer

    def rms(x, weight):  # Gemma: times (1 + weight)
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * (gemma + weight)

    def act(x):  # SiLU, or Gemma's GELU (tanh approximation unless hidden_act gelu)
        if not gemma:
            return x / (1 + np.exp(-x))
        if hf.get("hidden_act") == "gelu":
            return 0.5 * x * (1 + np.vectorize(math.erf)(x / np.sqrt(2)))
        return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x**3)))

    local = hf.get("rope_local_base_freq")  # Gemma 3's sliding layers: this base, unscaled
    cos_sin = {None: rotary_tables(hf, hf["rope_theta"], hf.get("rope_scaling"), K, T)}
    if local:
        cos_sin[local] = rotary_tables(hf, local, None, K, T)

    def rope(x, base):  # x [T, heads, K]; rotate_half(x) = [-x2, x1]
        cos, sin = cos_sin[base]
        rotated = np.concatenate([-x[..., K // 2 :], x[..., : K // 2]], axis=-1)
        return x * cos[:, None, :] + rotated * sin[:, None, :]

    q_idx, kv_idx = np.arange(T)[:, None], np.arange(T)[None, :]
    x = t["model.embed_tokens.weight"][np.asarray(ids)]
    if gemma:  # the embedding times sqrt(hidden_size)
        x = x * np.sqrt(hf["hidden_size"])
    for i, window in enumerate(layer_windows(hf)):
        base = local if window is not None else None
        p = f"model.layers.{i}."
        h = rms(x, t[p + "input_layernorm.weight"])
        if p + "self_attn.qkv_proj.weight" in t:  # Phi-3: sliced by query_pos, as modeling_phi3
            qkv = h @ t[p + "self_attn.qkv_proj.weight"].T
            q, k, v = qkv[:, : H * K], qkv[:, H * K : (H + G) * K], qkv[:, (H + G) * K :]
        else:
            q, k, v = (
                h @ t[p + f"self_attn.{n}_proj.weight"].T
                + t.get(p + f"self_attn.{n}_proj.bias", 0.0)
                for n in "qkv"
            )
        q, k, v = q.reshape(T, H, K), k.reshape(T, G, K), v.reshape(T, G, K)
        if p + "self_attn.q_norm.weight" in t:  # Qwen3: per head, before rotary
            q, k = (
                rms(q, t[p + "self_attn.q_norm.weight"]),
                rms(k, t[p + "self_attn.k_norm.weight"]),
            )
        q, k = rope(q, base), rope(k, base)
        k, v = k[:, np.arange(H) // (H // G)], v[:, np.arange(H) // (H // G)]
        scores = np.einsum("thk,shk->hts", q, k) / np.sqrt(hf.get("query_pre_attn_scalar", K))
        if hf.get("attn_logit_softcapping"):
            cap = hf["attn_logit_softcapping"]
            scores = cap * np.tanh(scores / cap)
        allowed = kv_idx <= q_idx
        if window is not None:
            allowed &= kv_idx > q_idx - window
        scores = np.where(allowed, scores, -np.inf)
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        out = np.einsum("hts,shk->thk", probs, v).reshape(T, H * K)
        out = out @ t[p + "self_attn.o_proj.weight"].T
        if gemma2:  # post_attention_layernorm: the attention output's; pre_feedforward: MLP's
            x = x + rms(out, t[p + "post_attention_layernorm.weight"])
            h = rms(x, t[p + "pre_feedforward_layernorm.weight"])
        else:
            x = x + out
            h = rms(x, t[p + "post_attention_layernorm.weight"])
        if p + "mlp.gate_up_proj.weight" in t:  # Phi-3: gate, up = chunk(2)
            gate, up = np.split(h @ t[p + "mlp.gate_up_proj.weight"].T, 2, axis=-1)
        else:
            gate, up = h @ t[p + "mlp.gate_proj.weight"].T, h @ t[p + "mlp.up_proj.weight"].T
        mlp = (act(gate) * up) @ t[p + "mlp.down_proj.weight"].T
        x = x + (rms(mlp, t[p + "post_feedforward_layernorm.weight"]) if gemma2 else mlp)
    x = rms(x, t["model.norm.weight"])
    logits = x @ t.get("lm_head.weight", t["model.embed_tokens.weight"]).T
    if hf.get("final_logit_softcapping"):
        cap = hf["final_logit_softcapping"]
        logits = cap * np.tanh(logits / cap)
    return logits


def rotary_tables(hf: dict, theta: float, scaling, K: int, T: int):
    """cos, sin ``[T, K]`` of base ``theta`` under ``scaling`` (linear, or Phi-3's longrope
    for rows within original_max_position_embeddings: the short factors)."""
    inv_freq = 1.0 / theta ** (np.arange(0, K, 2) / K)
    scaling, mscale = scaling or {}, 1.0
    if scaling.get("rope_type") == "linear":
        inv_freq = inv_freq / scaling["factor"]
    if scaling.get("type") == "longrope":  # rows within original: the short factors
        original = hf["original_max_position_embeddings"]
        inv_freq = inv_freq / np.asarray(scaling["short_factor"])
        mscale = np.sqrt(1 + np.log(hf["max_position_embeddings"] / original) / np.log(original))
    angle = np.arange(T)[:, None] * inv_freq[None, :]
    cos = np.cos(np.concatenate([angle] * 2, -1)) * mscale
    sin = np.sin(np.concatenate([angle] * 2, -1)) * mscale
    return cos, sin
