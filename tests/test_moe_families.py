"""Qwen2-MoE, Qwen3-MoE and OLMoE in, computed, generated, out.

As ``test_mixtral.py``: a tiny checkpoint per family written by hand (random tensors under the
names transformers' ``modeling_qwen2_moe.py``, ``modeling_qwen3_moe.py``, ``modeling_olmoe.py``
give them, saved with ``safetensors.numpy``, no torch) and a hand-written ``config.json``. The
reference is a float64 NumPy forward written here from transformers' PyTorch equations, sharing
no code with the project's model:

- the sparse block (``Qwen2MoeSparseMoeBlock``, ``Qwen3MoeSparseMoeBlock``,
  ``OlmoeSparseMoeBlock``): softmax over every expert's router logit, top-k, divided by the
  top-k's sum only with ``norm_topk_prob``; each expert ``down(silu(gate(x)) * up(x))``;
  Qwen2-MoE adds ``sigmoid(shared_expert_gate(x)) * shared_expert(x)``;
- the decoder layer: experts unless the layer is in ``mlp_only_layers`` or
  ``(layer + 1) % decoder_sparse_step != 0``, then the dense MLP of ``intermediate_size``;
- attention: Qwen2-MoE's q/k/v biases (``qkv_bias``); Qwen3-MoE's RMSNorm of each q/k head;
  OLMoE's RMSNorm of the whole projected q (``hidden``) and k (``kv_heads x head_dim``),
  before the heads are split.
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from minifield.hf import checkpoint as hf_checkpoint
from minifield.hf import config as hf_config
from minifield.models import model

_COMMON = {
    "vocab_size": 61,
    "hidden_size": 32,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "hidden_act": "silu",
    "output_router_logits": False,
    "attention_dropout": 0.0,
}
QWEN2_MOE = {
    "architectures": ["Qwen2MoeForCausalLM"],
    "model_type": "qwen2_moe",
    **_COMMON,
    "intermediate_size": 40,  # the dense layer's
    "moe_intermediate_size": 16,
    "shared_expert_intermediate_size": 24,
    "num_hidden_layers": 3,
    "num_experts": 6,
    "num_experts_per_tok": 2,
    "norm_topk_prob": False,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [1],
    "qkv_bias": True,
    "use_sliding_window": False,
    "sliding_window": None,
    "max_window_layers": 28,
    "router_aux_loss_coef": 0.001,
}
QWEN3_MOE = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    **_COMMON,
    "head_dim": 16,  # not hidden / heads
    "intermediate_size": 40,
    "moe_intermediate_size": 20,
    "num_hidden_layers": 3,
    "num_experts": 5,
    "num_experts_per_tok": 3,
    "norm_topk_prob": True,
    "decoder_sparse_step": 2,  # layers 0 and 2 dense
    "mlp_only_layers": [],
    "attention_bias": False,
    "use_sliding_window": False,
    "sliding_window": None,
    "router_aux_loss_coef": 0.001,
}
OLMOE = {
    "architectures": ["OlmoeForCausalLM"],
    "model_type": "olmoe",
    **_COMMON,
    "intermediate_size": 24,
    "num_hidden_layers": 2,
    "num_experts": 6,
    "num_experts_per_tok": 2,
    "norm_topk_prob": False,
    "attention_bias": False,
    "clip_qkv": None,
    "router_aux_loss_coef": 0.01,
    "pad_token_id": 1,
    "eos_token_id": 50,
}
FAMILIES = {"qwen2_moe": QWEN2_MOE, "qwen3_moe": QWEN3_MOE, "olmoe": OLMOE}
ROWS = [[1, 5, 7, 9, 11, 13, 2, 60, 3, 3, 40, 17], [56, 0, 4, 8, 15, 16, 23, 42, 8, 1, 9, 30]]


def moe_layer(hf: dict, i: int) -> bool:
    """transformers' rule: a sparse block unless listed in mlp_only_layers or off the step."""
    only, step = hf.get("mlp_only_layers", []), hf.get("decoder_sparse_step", 1)
    return i not in only and (i + 1) % step == 0


def head_dim(hf: dict) -> int:
    return hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]


def make_tensors(hf: dict, seed: int) -> dict[str, np.ndarray]:
    """Random FP32 tensors under transformers' names, ``[out, in]`` layouts."""
    rng = np.random.default_rng(seed)
    kind = hf["model_type"]
    D, V, E = hf["hidden_size"], hf["vocab_size"], hf["num_experts"]
    H, G, K = hf["num_attention_heads"], hf["num_key_value_heads"], head_dim(hf)
    expert_f = hf.get("moe_intermediate_size", hf["intermediate_size"])

    def w(*shape, scale=None):
        scale = shape[-1] ** -0.5 if scale is None else scale
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    def mlp(prefix, F):
        return {
            prefix + "gate_proj.weight": w(F, D),
            prefix + "up_proj.weight": w(F, D),
            prefix + "down_proj.weight": w(D, F),
        }

    t = {"model.embed_tokens.weight": w(V, D, scale=0.5), "model.norm.weight": 1 + w(D, scale=0.1)}
    for i in range(hf["num_hidden_layers"]):
        p = f"model.layers.{i}."
        t[p + "input_layernorm.weight"] = 1 + w(D, scale=0.1)
        t[p + "post_attention_layernorm.weight"] = 1 + w(D, scale=0.1)
        t[p + "self_attn.q_proj.weight"] = w(H * K, D)
        t[p + "self_attn.k_proj.weight"] = w(G * K, D)
        t[p + "self_attn.v_proj.weight"] = w(G * K, D)
        t[p + "self_attn.o_proj.weight"] = w(D, H * K)
        if kind == "qwen2_moe":
            for n, width in (("q", H * K), ("k", G * K), ("v", G * K)):
                t[p + f"self_attn.{n}_proj.bias"] = w(width, scale=0.3)
        if kind == "qwen3_moe":
            t[p + "self_attn.q_norm.weight"] = 1 + w(K, scale=0.1)
            t[p + "self_attn.k_norm.weight"] = 1 + w(K, scale=0.1)
        if kind == "olmoe":
            t[p + "self_attn.q_norm.weight"] = 1 + w(H * K, scale=0.1)
            t[p + "self_attn.k_norm.weight"] = 1 + w(G * K, scale=0.1)
        if not moe_layer(hf, i):
            t.update(mlp(p + "mlp.", hf["intermediate_size"]))
            continue
        t[p + "mlp.gate.weight"] = w(E, D, scale=0.5)
        for j in range(E):
            t.update(mlp(p + f"mlp.experts.{j}.", expert_f))
        if kind == "qwen2_moe":
            t.update(mlp(p + "mlp.shared_expert.", hf["shared_expert_intermediate_size"]))
            t[p + "mlp.shared_expert_gate.weight"] = w(1, D)
    t["lm_head.weight"] = w(V, D)
    return t


def write_checkpoint(directory, hf: dict, tensors: dict):
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    (directory / "config.json").write_text(json.dumps(hf))
    return directory


def reference_logits(t: dict, hf: dict, ids, routing=None) -> np.ndarray:
    """One unpacked row, float64, from the modeling files' equations; ``routing`` (a list)
    collects each sparse layer's top-k margin (k-th router logit minus the next)."""
    t = {k: v.astype(np.float64) for k, v in t.items()}
    kind = hf["model_type"]
    H, G, K = hf["num_attention_heads"], hf["num_key_value_heads"], head_dim(hf)
    k, eps, T = hf["num_experts_per_tok"], hf["rms_norm_eps"], len(ids)

    def rms(x, weight):
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * weight

    inv_freq = 1.0 / hf["rope_theta"] ** (np.arange(0, K, 2) / K)
    angle = np.arange(T)[:, None] * inv_freq[None, :]
    cos, sin = np.cos(np.concatenate([angle] * 2, -1)), np.sin(np.concatenate([angle] * 2, -1))

    def rope(x):  # rotate_half(x) = [-x2, x1]
        rotated = np.concatenate([-x[..., K // 2 :], x[..., : K // 2]], axis=-1)
        return x * cos[:, None, :] + rotated * sin[:, None, :]

    def silu(x):
        return x / (1 + np.exp(-x))

    def mlp(x, prefix):
        gate, up = x @ t[prefix + "gate_proj.weight"].T, x @ t[prefix + "up_proj.weight"].T
        return (silu(gate) * up) @ t[prefix + "down_proj.weight"].T

    causal = np.arange(T)[None, :] <= np.arange(T)[:, None]
    x = t["model.embed_tokens.weight"][np.asarray(ids)]
    for i in range(hf["num_hidden_layers"]):
        p = f"model.layers.{i}."
        h = rms(x, t[p + "input_layernorm.weight"])
        q, kk, v = (h @ t[p + f"self_attn.{n}_proj.weight"].T for n in "qkv")
        if kind == "qwen2_moe":
            q, kk, v = (
                a + t[p + f"self_attn.{n}_proj.bias"]
                for a, n in zip((q, kk, v), "qkv", strict=True)
            )
        if kind == "olmoe":  # the whole projection, before the heads are split
            q = rms(q, t[p + "self_attn.q_norm.weight"])
            kk = rms(kk, t[p + "self_attn.k_norm.weight"])
        q, kk, v = q.reshape(T, H, K), kk.reshape(T, G, K), v.reshape(T, G, K)
        if kind == "qwen3_moe":  # each head
            q = rms(q, t[p + "self_attn.q_norm.weight"])
            kk = rms(kk, t[p + "self_attn.k_norm.weight"])
        q, kk = rope(q), rope(kk)
        kk, v = kk[:, np.arange(H) // (H // G)], v[:, np.arange(H) // (H // G)]
        scores = np.einsum("thk,shk->hts", q, kk) / np.sqrt(K)
        scores = np.where(causal, scores, -np.inf)
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        out = np.einsum("hts,shk->thk", probs, v).reshape(T, H * K)
        x = x + out @ t[p + "self_attn.o_proj.weight"].T
        h = rms(x, t[p + "post_attention_layernorm.weight"])
        if not moe_layer(hf, i):
            x = x + mlp(h, p + "mlp.")
            continue
        logits = h @ t[p + "mlp.gate.weight"].T
        router = np.exp(logits - logits.max(-1, keepdims=True))
        router /= router.sum(-1, keepdims=True)
        ranked = np.argsort(-router, axis=-1, kind="stable")
        if routing is not None and k < hf["num_experts"]:
            ranked_logits = np.take_along_axis(logits, ranked, -1)
            routing.append(float((ranked_logits[:, k - 1] - ranked_logits[:, k]).min()))
        sparse = np.zeros_like(h)
        for token in range(T):
            chosen = ranked[token, :k]
            weights = router[token, chosen]
            if hf["norm_topk_prob"]:
                weights = weights / weights.sum()
            for j, weight in zip(chosen, weights, strict=True):
                sparse[token] += weight * mlp(h[token], p + f"mlp.experts.{j}.")
        if kind == "qwen2_moe":
            gate = 1 / (1 + np.exp(-(h @ t[p + "mlp.shared_expert_gate.weight"].T)))
            sparse = sparse + gate * mlp(h, p + "mlp.shared_expert.")
        x = x + sparse
    return rms(x, t["model.norm.weight"]) @ t["lm_head.weight"].T


@pytest.fixture(scope="module", params=list(FAMILIES))
def case(request, tmp_path_factory):
    hf = FAMILIES[request.param]
    tensors = make_tensors(hf, seed=7)
    directory = write_checkpoint(tmp_path_factory.mktemp(request.param) / "base", hf, tensors)
    cfg, params = hf_checkpoint.load(directory, max_len=32, compute_dtype="float32")
    return {"hf": hf, "tensors": tensors, "dir": directory, "cfg": cfg, "params": params}


# one compiled program per config and row length; run op by op, the forward compiled each
# primitive, and each layer's scan afresh, in every test
forward = jax.jit(model.forward, static_argnums=1)


def our_logits(cfg, params, row) -> np.ndarray:
    arrays = (jnp.asarray([x], jnp.int32) for x in (row, [1] * len(row), list(range(len(row)))))
    return np.asarray(forward(params, cfg, *arrays))[0]


# -- config.json -----------------------------------------------------------------------------------


def test_config_json_fields_are_read():
    cfg = hf_config.config_from_hf(QWEN2_MOE, max_len=32)
    assert (cfg.n_experts, cfg.experts_per_token, cfg.d_ff, cfg.moe_d_ff) == (6, 2, 40, 16)
    assert (cfg.shared_expert_d_ff, cfg.dense_layers, cfg.norm_topk) == (24, (1,), False)
    assert (cfg.qkv_bias, cfg.qk_norm, cfg.moe_names) == (True, False, "mlp")
    assert not hf_config.config_from_hf({**QWEN2_MOE, "qkv_bias": False}, max_len=32).qkv_bias
    cfg = hf_config.config_from_hf(QWEN3_MOE, max_len=32)
    assert (cfg.head_dim, cfg.qk_norm, cfg.qk_norm_whole, cfg.dense_layers) == (
        16,
        True,
        False,
        (0, 2),
    )
    assert (cfg.shared_expert_d_ff, cfg.norm_topk, cfg.moe_d_ff) == (0, True, 20)
    cfg = hf_config.config_from_hf(OLMOE, max_len=32)
    assert (cfg.qk_norm, cfg.qk_norm_whole, cfg.norm_topk, cfg.d_ff, cfg.dense_layers) == (
        True,
        True,
        False,
        24,
        (),
    )
    # transformers' defaults when absent
    bare = {
        k: v
        for k, v in QWEN3_MOE.items()
        if k not in ("num_experts", "num_experts_per_tok", "norm_topk_prob", "decoder_sparse_step")
    }
    cfg = hf_config.config_from_hf({**bare, "num_experts_per_tok": 2}, max_len=32)
    assert (cfg.n_experts, cfg.norm_topk, cfg.dense_layers) == (128, False, ())
    for hf in FAMILIES.values():
        cfg = hf_config.config_from_hf(hf, max_len=32)
        assert model.config_from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg


@pytest.mark.parametrize(
    "hf, change, message",
    [
        (QWEN2_MOE, {"router_jitter_noise": 0.1}, r"router_jitter_noise 0.1 is not supported"),
        (QWEN2_MOE, {"router_aux_loss_coef": -0.1}, r"router_aux_loss_coef -0.1 is negative"),
        (QWEN2_MOE, {"use_sliding_window": True}, r"use_sliding_window true is not supported"),
        (QWEN2_MOE, {"mlp_only_layers": [3]}, r"mlp_only_layers \[3\] names layers outside"),
        (QWEN2_MOE, {"mlp_only_layers": "1"}, r"mlp_only_layers must be a list of integers"),
        (QWEN3_MOE, {"num_experts_per_tok": 6}, r"num_experts_per_tok 6 exceeds num_experts 5"),
        (QWEN3_MOE, {"attention_bias": True}, r"attention_bias true .* is not supported"),
        (QWEN3_MOE, {"decoder_sparse_step": 0}, r"decoder_sparse_step must be a positive"),
        (OLMOE, {"clip_qkv": 8.0}, r"clip_qkv 8.0 is not supported"),
        (OLMOE, {"head_dim": 16}, r"head_dim 16 is not supported"),
        (OLMOE, {"norm_topk_prob": "yes"}, r"norm_topk_prob must be a boolean"),
    ],
)
def test_what_is_not_computed_is_refused_naming_file_and_field(tmp_path, hf, change, message):
    directory = write_checkpoint(tmp_path / "bad", {**hf, **change}, {"x": np.zeros(1, np.float32)})
    with pytest.raises(
        hf_checkpoint.CheckpointError, match=str(directory) + "/config.json: " + message
    ):
        hf_checkpoint.load(directory, max_len=32)


def test_a_missing_shared_expert_tensor_is_refused_naming_it(tmp_path):
    tensors = make_tensors(QWEN2_MOE, seed=1)
    del tensors["model.layers.2.mlp.shared_expert_gate.weight"]
    directory = write_checkpoint(tmp_path / "missing", QWEN2_MOE, tensors)
    with pytest.raises(hf_checkpoint.CheckpointError, match=r"shared_expert_gate.weight missing"):
        hf_checkpoint.load(directory, max_len=32)


# -- the forward -----------------------------------------------------------------------------------


def test_logits_match_the_written_equations(case):
    for row in ROWS:
        margins: list[float] = []
        expected = reference_logits(case["tensors"], case["hf"], row, margins)
        assert min(margins) > 1e-3  # no top-k near-tie that FP32 could break the other way
        np.testing.assert_allclose(
            our_logits(case["cfg"], case["params"], row), expected, atol=1e-4
        )


def test_the_family_rules_change_the_logits(case):
    """Renormalising the top-k (or not), and the layers' kinds, change the logits: the test
    above could not pass with the other choice."""
    hf, row = case["hf"], ROWS[0]
    flipped = {**hf, "norm_topk_prob": not hf["norm_topk_prob"]}
    cfg = hf_config.config_from_hf(flipped, max_len=32, compute_dtype="float32")
    other = our_logits(cfg, case["params"], row)
    assert np.abs(other - our_logits(case["cfg"], case["params"], row)).max() > 1e-2
    np.testing.assert_allclose(other, reference_logits(case["tensors"], flipped, row), atol=1e-4)


@pytest.mark.slow
def test_cached_greedy_generation_equals_uncached_and_the_reference(case):
    cfg, params = case["cfg"], case["params"]
    prompt, expected = ROWS[1][:5], []
    for _ in range(6):
        logits = reference_logits(case["tensors"], case["hf"], prompt + expected)
        expected.append(int(np.argmax(logits[-1])))
    cached = model.greedy_generate(params, cfg, prompt, 6, None)
    uncached = model.greedy_generate(params, cfg, prompt, 6, None, cache=False)
    assert cached == uncached == expected


# -- out -------------------------------------------------------------------------------------------


def test_export_then_load_is_byte_equal_and_config_field_by_field(case, tmp_path):
    cfg, params, hf = case["cfg"], case["params"], case["hf"]
    with_base, without = tmp_path / "with-base", tmp_path / "without"
    hf_checkpoint.write(with_base, cfg, params, base_config=hf)
    written_config = json.loads((with_base / "config.json").read_text())
    assert written_config == {**hf, "torch_dtype": "float32"}
    written = load_file(str(with_base / "model.safetensors"))
    assert sorted(written) == sorted(case["tensors"])
    for key, value in case["tensors"].items():
        assert written[key].dtype == value.dtype and written[key].tobytes() == value.tobytes(), key
    again, _ = hf_checkpoint.load(with_base, max_len=32, compute_dtype="float32")
    assert again == cfg
    # without a base config.json: the same family's config, read back as the same model
    hf_checkpoint.write(without, cfg, params)
    config = json.loads((without / "config.json").read_text())
    assert (config["model_type"], config["architectures"]) == (
        hf["model_type"],
        hf["architectures"],
    )
    again, params_again = hf_checkpoint.load(without, max_len=32, compute_dtype="float32")
    assert again == cfg
    np.testing.assert_array_equal(
        our_logits(again, params_again, ROWS[1]), our_logits(cfg, params, ROWS[1])
    )
