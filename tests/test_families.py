"""Model families beyond the plain Llama block: Mistral's sliding window, Qwen2's
``use_sliding_window`` (per-layer windows), Qwen3's q/k norms and explicit ``head_dim``.

Each checkpoint is random tensors under the HF names, written by hand here (not the project's
name table), with real ``config.json`` field names and scaled-down shapes. The reference is a
float64 NumPy forward written below from transformers' PyTorch ``modeling_mistral.py``,
``modeling_qwen2.py``, ``modeling_qwen3.py`` and ``masking_utils.py`` (sliding window: key
position ``> query position - sliding_window``), sharing no code with the project.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from minifield.strategies.packed_sft import hf_checkpoint, hf_config, model
from minifield.strategies.packed_sft.execution import Execution
from minifield.strategies.packed_sft.hf_checkpoint import CheckpointError

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
    """Random FP32 tensors under HF's PyTorch names and ``[out, in]`` layouts."""
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


def packed_logits(cfg, params, tokens, segments, positions) -> np.ndarray:
    arrays = (jnp.asarray([x], jnp.int32) for x in (tokens, segments, positions))
    return np.asarray(model.forward(params, cfg, *arrays))[0]


def our_logits(cfg, params, row) -> np.ndarray:
    return packed_logits(cfg, params, row, [1] * len(row), list(range(len(row))))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, dict]:
    root = tmp_path_factory.mktemp("families")
    out = {}
    for n, (name, hf) in enumerate(CONFIGS.items()):
        tensors = hf_tensors(hf, seed=10 + n)
        out[name] = {
            "hf": hf,
            "tensors": tensors,
            "dir": write_checkpoint(root / name, hf, tensors),
        }
    return out


# -- what config.json means --------------------------------------------------------------------


def test_each_family_reads_its_fields():
    mistral = hf_config.config_from_hf(MISTRAL, max_len=32)
    assert (mistral.sliding_window, mistral.layer_types, mistral.qk_norm) == (4, (), False)
    qwen2 = hf_config.config_from_hf(QWEN2, max_len=32)
    assert qwen2.qkv_bias and qwen2.sliding_window == 5
    assert [qwen2.layer_window(i) for i in range(2)] == [None, 5]
    qwen3 = hf_config.config_from_hf(QWEN3, max_len=32)
    assert (qwen3.head_dim, qwen3.qk_norm, qwen3.qkv_bias, qwen3.sliding_window) == (
        12,
        True,
        False,
        None,
    )
    # transformers' defaults: Qwen3 head_dim 128; Qwen2 window only with use_sliding_window,
    # 4096 when the key is absent, on layers >= max_window_layers (absent: 28)
    bare = {k: v for k, v in QWEN3.items() if k != "head_dim"}
    assert hf_config.config_from_hf(bare, max_len=32).head_dim == 128
    assert hf_config.config_from_hf({**QWEN2, "use_sliding_window": False}).sliding_window is None
    every = {k: v for k, v in QWEN2.items() if k != "sliding_window"} | {"max_window_layers": 0}
    assert (
        hf_config.config_from_hf(every).sliding_window,
        hf_config.config_from_hf(every).layer_types,
    ) == (4096, ())
    assert hf_config.config_from_hf({**QWEN2, "max_window_layers": 2}).sliding_window is None
    # Mistral's window reaching every position is no window (its own v0.2+ configs)
    assert hf_config.config_from_hf({**MISTRAL, "sliding_window": 64}).sliding_window is None


# -- logits against the written equations --------------------------------------------------------


@pytest.mark.parametrize("name", list(CONFIGS))
def test_logits_match_the_written_equations(checkpoints, name):
    case = checkpoints[name]
    cfg, params = hf_checkpoint.load(case["dir"], max_len=32, compute_dtype="float32")
    for row in ROWS:
        np.testing.assert_allclose(
            our_logits(cfg, params, row),
            reference_logits(case["tensors"], case["hf"], row),
            atol=1e-4,
        )


def test_the_window_changes_the_logits(checkpoints):
    """The reference with and without the window differ on these rows: the test above could
    not pass with the window ignored."""
    case = checkpoints["mistral-window"]
    unwindowed = {**case["hf"], "sliding_window": None}
    windowed = reference_logits(case["tensors"], case["hf"], ROWS[0])
    assert np.abs(windowed - reference_logits(case["tensors"], unwindowed, ROWS[0])).max() > 1e-2


@pytest.mark.slow
@pytest.mark.parametrize("name", ["mistral-window", "qwen2-window-layer-1", "gemma3"])
def test_each_segment_of_a_packed_row_equals_the_example_alone(checkpoints, name):
    cfg, params = hf_checkpoint.load(checkpoints[name]["dir"], max_len=32, compute_dtype="float32")
    a, b, c = ROWS[0][:7], ROWS[1][:9], ROWS[0][3:8]
    tokens = a + b + c + [0, 0]
    segments = [1] * 7 + [2] * 9 + [3] * 5 + [0, 0]
    positions = list(range(7)) + list(range(9)) + list(range(5)) + [0, 1]
    packed = packed_logits(cfg, params, tokens, segments, positions)
    for example, start in ((a, 0), (b, 7), (c, 16)):
        alone = our_logits(cfg, params, example)
        np.testing.assert_allclose(packed[start : start + len(example)], alone, atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["mistral-window", "qwen3-window-tied", "gemma2", "gemma3"])
def test_cached_generation_follows_the_reference_argmax(checkpoints, name):
    """Greedy tokens with the key/value cache (windowed over cache slots) equal the argmax of
    the reference forward over the growing row, past the window."""
    case = checkpoints[name]
    cfg, params = hf_checkpoint.load(case["dir"], max_len=32, compute_dtype="float32")
    prompt, expected = ROWS[0][:5], []
    for _ in range(8):
        logits = reference_logits(case["tensors"], case["hf"], prompt + expected)
        expected.append(int(np.argmax(logits[-1])))
    assert model.greedy_generate(params, cfg, prompt, 8, None) == expected


# -- export ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(CONFIGS))
def test_export_then_load_gives_the_same_model_and_logits(checkpoints, tmp_path, name):
    case = checkpoints[name]
    cfg, params = hf_checkpoint.load(case["dir"], max_len=32, compute_dtype="float32")
    with_base, without = tmp_path / "with-base", tmp_path / "without"
    hf_checkpoint.write(with_base, cfg, params, base_config=case["hf"])
    assert json.loads((with_base / "config.json").read_text()) == {
        **case["hf"],
        "torch_dtype": "float32",
    }
    written = load_file(str(with_base / "model.safetensors"))
    assert sorted(written) == sorted(case["tensors"])
    for key, value in case["tensors"].items():
        np.testing.assert_array_equal(written[key], value, err_msg=key)
    # without a base config.json: the family config_to_hf picks reads back as the same model
    hf_checkpoint.write(without, cfg, params)
    again, params_again = hf_checkpoint.load(without, max_len=32, compute_dtype="float32")
    assert again == cfg
    assert (
        json.loads((without / "config.json").read_text())["model_type"] == case["hf"]["model_type"]
    )
    np.testing.assert_array_equal(
        our_logits(again, params_again, ROWS[1]), our_logits(cfg, params, ROWS[1])
    )


def test_to_dict_round_trips_and_leaves_out_what_is_unset(checkpoints):
    cfg = hf_config.config_from_hf(CONFIGS["qwen3-window-tied"], max_len=32)
    d = cfg.to_dict()
    assert d["head_dim"] == 12 and d["layer_types"] == ["sliding_attention", "full_attention"]
    assert model.config_from_dict(json.loads(json.dumps(d))) == cfg
    longrope = hf_config.config_from_hf(CONFIGS["phi3-longrope"], max_len=32)
    d = longrope.to_dict()
    assert d["fused_projections"] and d["rope_scaling"]["short_factor"] == [1.0, 1.3, 2.5, 6.0]
    assert model.config_from_dict(json.loads(json.dumps(d))) == longrope
    plain = hf_config.config_from_hf({**BASE, "model_type": "llama"}, max_len=32).to_dict()
    assert not {"head_dim", "qk_norm", "sliding_window", "layer_types"} & set(plain)


# -- refusals -----------------------------------------------------------------------------------


def _broken(tmp_path, hf, edit=None, config=None) -> Path:
    tensors = hf_tensors(hf, seed=3)
    if edit:
        edit(tensors)
    return write_checkpoint(tmp_path / "ckpt", config or hf, tensors)


def test_a_missing_q_norm_tensor_is_named(tmp_path):
    name = "model.layers.1.self_attn.q_norm.weight"
    directory = _broken(tmp_path, QWEN3, edit=lambda t: t.pop(name))
    with pytest.raises(CheckpointError, match=f"^{directory}: tensor {name} missing"):
        hf_checkpoint.load(directory)


def test_a_head_dim_that_does_not_match_the_tensors_is_named(tmp_path):
    directory = _broken(tmp_path, QWEN3, config={**QWEN3, "head_dim": 8})
    with pytest.raises(
        CheckpointError,
        match=rf"^{directory / 'model.safetensors'}: tensor model.layers.0.self_attn.q_proj.weight "
        r"has shape \[48, 32\], config.json implies \[32, 32\] "
        r"\(num_attention_heads x head_dim, hidden_size\)",
    ):
        hf_checkpoint.load(directory)


@pytest.mark.parametrize(
    "config, message",
    [
        (
            {**QWEN3, "attention_bias": True},
            r"attention_bias true \(an o_proj bias\) is not supported",
        ),
        (
            {**QWEN3, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}},
            r"rope_scaling.rope_type 'yarn' is not supported",
        ),
        ({**QWEN3, "head_dim": 7}, r"model.n_heads: rotary needs an even head size, got 7"),
        ({**MISTRAL, "sliding_window": 0}, r"sliding_window must be a positive integer, found 0"),
        (
            {**QWEN2, "layer_types": ["sliding_attention"]},
            r"layer_types must be 2 \(num_hidden_layers\) of 'sliding_attention', 'full_attention'",
        ),
        (
            {
                **CONFIGS["phi3-longrope"],
                "max_position_embeddings": 128,
                "original_max_position_embeddings": 16,
            },
            r"rope_scaling.rope_type 'longrope' with rows of 32 positions beyond "
            r"original_max_position_embeddings 16 is not supported",
        ),
        (
            {
                **PHI3,
                "rope_scaling": {"type": "longrope", "short_factor": [1.0], "long_factor": [1.0]},
            },
            r"rope_scaling.long_factor must be 4 positive numbers \(head_dim / 2\)",
        ),
        (
            {**GEMMA, "hidden_activation": "gelu"},
            r"hidden_activation 'gelu' differs from hidden_act 'gelu_pytorch_tanh'",
        ),
        (
            {**GEMMA, "model_type": "gemma3", "architectures": ["Gemma3ForConditionalGeneration"]},
            r"architectures \['Gemma3ForConditionalGeneration'\] is not supported",
        ),
        (
            {**GEMMA3, "use_bidirectional_attention": True},
            r"use_bidirectional_attention true is not supported \(causal only\)",
        ),
        (
            {**PHI3, "partial_rotary_factor": 0.75},
            r"partial_rotary_factor 0.75 is not supported \(expected 1.0\)",
        ),
        (
            {**QWEN2, "layer_types": ["chunked_attention", "full_attention"]},
            r"layer_types must be 2 \(num_hidden_layers\)",
        ),
    ],
)
def test_unsupported_fields_are_refused_naming_the_file_and_field(tmp_path, config, message):
    directory = _broken(
        tmp_path, QWEN3 if config["model_type"] == "qwen3" else config, config=config
    )
    with pytest.raises(CheckpointError, match=rf"^{directory / 'config.json'}: {message}"):
        hf_checkpoint.load(directory, max_len=32)


def test_the_fused_kernel_refuses_a_window_that_binds():
    cfg = hf_config.config_from_hf(MISTRAL, max_len=32)
    with pytest.raises(
        ValueError, match=r"model.attention pallas: .* sliding_window 4 < the rows' 32"
    ):
        dataclasses.replace(cfg, execution=Execution(attention="pallas"))
    # a window no row reaches is no window: the fused kernel computes the same
    wide = hf_config.config_from_hf({**MISTRAL, "sliding_window": 40}, max_len=32)
    dataclasses.replace(wide, execution=Execution(attention="pallas"))
    capped = hf_config.config_from_hf({**GEMMA2, "sliding_window": 40}, max_len=32)
    with pytest.raises(ValueError, match=r"no score soft-capping \(attn_logit_softcapping 5.0\)"):
        dataclasses.replace(capped, execution=Execution(attention="pallas"))
    mixed = hf_config.config_from_hf(QWEN2, max_len=32)
    with pytest.raises(ValueError, match=r"model.scan_layers: layers with and without"):
        dataclasses.replace(mixed, execution=Execution(scan_layers=True))


# -- recipes ----------------------------------------------------------------------------------


def test_recipe_fields_keep_the_digest_when_spelled_at_their_absent_value():
    from test_llama import _recipe

    from minifield import recipe as recipes
    from minifield.strategies.packed_sft import settings

    base = {"architecture": "llama", "d_model": 32, "n_layers": 1, "n_heads": 4, "d_ff": 64}
    plain = recipes.validate(_recipe(base))
    assert not {"head_dim", "qk_norm", "sliding_window"} & set(plain.data["model"])
    spelled = recipes.validate(_recipe({**base, "head_dim": 8, "qk_norm": False}))
    assert spelled.computation_digest == plain.computation_digest
    qwen3_like = recipes.validate(_recipe({**base, "head_dim": 12, "qk_norm": True}))
    windowed = recipes.validate(_recipe({**base, "sliding_window": 4}))
    digests = {r.computation_digest for r in (plain, qwen3_like, windowed)}
    assert len(digests) == 3
    cfg = settings.model_config(qwen3_like.data, vocab_size=260)
    assert (cfg.head_dim, cfg.qk_norm, cfg.sliding_window) == (12, True, None)
    assert settings.model_config(windowed.data, vocab_size=260).sliding_window == 4
    with pytest.raises(recipes.RecipeError) as info:
        recipes.validate(_recipe({"d_model": 32, "n_heads": 2, "sliding_window": 4}))
    assert {e["path"]: e["message"] for e in info.value.errors} == {
        "/model/sliding_window": "only for model.architecture llama"
    }


def _base_of_family(tmp_path, hf: dict) -> tuple[Path, dict]:
    """test_base_model's inputs with the base model replaced by one of ``hf``'s family."""
    from test_base_model import make_inputs

    root = tmp_path / "in"
    make_inputs(root)
    hf = {**hf, "vocab_size": 340}  # test_base_model's tokenizer
    write_checkpoint(root / "base", hf, hf_tensors(hf, seed=4))
    return root, hf


def test_a_qwen3_base_prepares_and_recipe_keys_must_agree_with_it(tmp_path):
    from test_base_model import _prepare, base_recipe

    from minifield.strategies.packed_sft import base_model

    root, _ = _base_of_family(tmp_path, QWEN3)
    _, (arrays, meta) = _prepare(base_recipe(root), root)
    config = meta["base_model"]["config"]
    assert config["qk_norm"] and config["head_dim"] == 12
    assert arrays["base.blocks.01.attn.q_norm"].shape == (12,)
    with pytest.raises(base_model.BaseModelError, match=r"config.json: head_dim gives head_dim=12"):
        _prepare(base_recipe(root, {"head_dim": 8}), root)


def test_lora_on_a_fused_phi3_base_is_refused_naming_config_json(tmp_path):
    from test_base_model import _prepare, base_recipe

    from minifield.strategies.packed_sft import base_model

    root, _ = _base_of_family(tmp_path, PHI3)
    with pytest.raises(
        base_model.BaseModelError,
        match=rf"^{root / 'base' / 'config.json'}: model_type phi3 stores qkv_proj and "
        "gate_up_proj fused; LoRA",
    ):
        _prepare(base_recipe(root, {"lora": {"rank": 2}}), root)


@pytest.mark.slow
def test_gemma_logits_and_greedy_tokens_equal_transformers_flax(checkpoints, monkeypatch):
    """transformers' own Flax Gemma (its rotary base is fixed at 10000, this config's)."""
    import test_llama
    import transformers

    monkeypatch.setattr(test_llama, "_flax_class", lambda hf: transformers.FlaxGemmaForCausalLM)
    case = checkpoints["gemma"]
    assert case["hf"]["rope_theta"] == 10000.0
    reference = test_llama._flax_model(case["dir"], {**case["hf"], "tie_word_embeddings": True})
    cfg, params = hf_checkpoint.load(case["dir"], max_len=32, compute_dtype="float32")
    theirs = np.asarray(reference(np.asarray(ROWS, np.int32)).logits)
    for row, logits in zip(ROWS, theirs, strict=True):
        np.testing.assert_allclose(our_logits(cfg, params, row), logits, atol=1e-4)
    prompt = ROWS[0][:6]
    generated = reference.generate(
        np.asarray([prompt], np.int32), max_new_tokens=6, do_sample=False, pad_token_id=0
    ).sequences
    assert (
        model.greedy_generate(params, cfg, prompt, 6, None)
        == np.asarray(generated)[0, len(prompt) :].tolist()
    )
