"""The family table (:mod:`minifield.models.families`) without compiling a model: which family
an export is written as, what an absent ``config.json`` field means (transformers' defaults,
written out here), how fused matrices split and join (NumPy slices of a numbered matrix) and
how many bytes the FP32 parameters take (the parameter count summed by hand)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from family_reference import GEMMA3, QWEN2

from minifield.hf import config as hf_config
from minifield.models import families
from minifield.models.families import FULL, SLIDING
from minifield.models.llama_config import LlamaConfig

#: V, D, layers, heads, kv heads, F: head size 8, HK = 32, GK = 16
SIZES = {"vocab_size": 61, "d_model": 32, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2}
SIZES |= {"d_ff": 40, "max_len": 16, "compute_dtype": "float32"}


def _cfg(**features) -> LlamaConfig:
    return LlamaConfig(**SIZES, **features)


PER_LAYER = {"sliding_window": 4, "layer_types": (FULL, SLIDING)}


@pytest.mark.parametrize(
    ("features", "model_type"),
    [
        ({}, "llama"),
        ({"sliding_window": 4}, "mistral"),  # every layer
        ({"qkv_bias": True}, "qwen2"),
        ({"qkv_bias": True, **PER_LAYER}, "qwen2"),
        ({"qk_norm": True}, "qwen3"),
        ({"qk_norm": True, **PER_LAYER}, "qwen3"),
        ({"norm_plus_one": True, "scale_embeddings": True}, "gemma"),
        ({"norm_plus_one": True, "sandwich_norms": True, **PER_LAYER}, "gemma2"),
        ({"norm_plus_one": True, "sandwich_norms": True, "qk_norm": True}, "gemma3_text"),
        ({"fused_projections": True, "sliding_window": 4}, "phi3"),
    ],
)
def test_an_export_is_written_as_the_simplest_family_holding_the_model(features, model_type):
    cfg = _cfg(**features)
    assert families.family_of(cfg).model_type == model_type
    assert hf_config.config_to_hf(cfg)["model_type"] == model_type


def test_per_layer_windows_without_qwens_biases_have_no_family():
    """Windows on some layers only: Mistral's window is on every layer, Llama has none, so no
    family holds the model and the export without a base config.json is refused."""
    cfg = _cfg(**PER_LAYER)
    assert families.family_of(cfg).model_type == "llama"
    with pytest.raises(ValueError, match="no HF family holds"):
        hf_config.config_to_hf(cfg)


@pytest.mark.parametrize(
    ("qkv_bias", "qk_norm", "window"), list(itertools.product((False, True), repeat=3))
)
def test_every_recipe_model_is_held_by_its_family_or_refused(qkv_bias, qk_norm, window):
    """The recipe's llama keys (``qkv_bias``, ``qk_norm``, ``sliding_window`` on every
    layer), in every combination: the family written holds each feature, or the export is
    refused."""
    cfg = _cfg(qkv_bias=qkv_bias, qk_norm=qk_norm, sliding_window=4 if window else None)
    if qkv_bias and qk_norm:  # no family has both (Qwen2 the biases, Qwen3 the norms)
        with pytest.raises(ValueError, match="no HF family holds q/k/v biases"):
            hf_config.config_to_hf(cfg)
        return
    hf = hf_config.config_to_hf(cfg)
    family = families.FAMILIES[hf["model_type"]]
    assert family.qkv_bias == qkv_bias and family.qk_norm == qk_norm
    assert ("sliding_window" in hf) == window


def test_absent_fields_mean_transformers_defaults():
    """transformers' config defaults: Gemma 3's ``rope_theta`` 1e6 (Llama's 1e4), Qwen2's
    ``max_window_layers`` 28 (layers 28 and up slide), Qwen3's ``head_dim`` 128."""
    bare_gemma3 = {k: v for k, v in GEMMA3.items() if k != "rope_theta"}
    assert hf_config.config_from_hf(bare_gemma3, max_len=32).rope_theta == 1_000_000.0
    llama = {**QWEN2, "architectures": ["LlamaForCausalLM"], "model_type": "llama"}
    llama = {k: v for k, v in llama.items() if k not in ("rope_theta", "use_sliding_window")}
    assert hf_config.config_from_hf(llama, max_len=32).rope_theta == 10_000.0
    deep = {k: v for k, v in QWEN2.items() if k != "max_window_layers"}
    deep["num_hidden_layers"] = 30
    cfg = hf_config.config_from_hf(deep, max_len=32)
    assert [cfg.layer_window(i) for i in (0, 27, 28, 29)] == [None, None, 5, 5]


def test_attention_bias_is_refused_where_it_means_an_o_proj_bias():
    """``attention_bias: true`` adds an o_proj bias in Llama-style configs (refused); Qwen2
    has no such field (its q/k/v biases are the family's), so there it changes nothing."""
    llama = {**QWEN2, "architectures": ["LlamaForCausalLM"], "model_type": "llama"}
    with pytest.raises(ValueError, match=r"attention_bias true \(an o_proj bias\)"):
        hf_config.config_from_hf({**llama, "attention_bias": True}, max_len=32)
    plain = hf_config.config_from_hf(QWEN2, max_len=32)
    assert hf_config.config_from_hf({**QWEN2, "attention_bias": True}, max_len=32) == plain


QKV = ("blocks/00/attn/wq", "blocks/00/attn/wk", "blocks/00/attn/wv")
GATE_UP = ("blocks/00/mlp/w_gate", "blocks/00/mlp/w_up")


@pytest.mark.parametrize(("path", "widths"), [(QKV, (32, 16, 16)), (GATE_UP, (40, 40))])
def test_fused_matrices_split_into_their_parts_and_join_back(path, widths):
    """A fused matrix stored ``[out, in]`` holds its parts' rows one after another (Phi-3's
    ``qkv_proj``: queries 4 x 8, keys 2 x 8, values 2 x 8; ``gate_up_proj``: 40 + 40);
    read as ``[in, out]`` it holds their columns."""
    cfg = _cfg(fused_projections=True)
    stored = np.arange(sum(widths) * 32, dtype=np.float32).reshape(sum(widths), 32)
    edges = np.concatenate([[0], np.cumsum(widths)])
    by_hand = [stored[a:b] for a, b in itertools.pairwise(edges)]
    parts = families.split_stored(cfg, path, stored)
    assert [p for p, _ in parts] == list(path)
    for (_, part), want in zip(parts, by_hand, strict=True):
        np.testing.assert_array_equal(part, want)
        assert np.shares_memory(part, stored)  # views, no copy
    columns = families.split(cfg, path, stored.T)
    for (_, part), want in zip(columns, by_hand, strict=True):
        np.testing.assert_array_equal(part, want.T)
        assert part.flags.c_contiguous
    lookup = dict(zip(path, (want.T for want in by_hand), strict=True))
    np.testing.assert_array_equal(families.join(path, lookup.__getitem__), stored.T)


@pytest.mark.parametrize("tied", [False, True])
def test_fp32_bytes_are_four_per_parameter(tied):
    V, D, L, F, HK, GK = 61, 32, 2, 40, 32, 16
    per_layer = D + D * HK + 2 * D * GK + HK * D + D + 3 * D * F  # norms, q k v o, MLP
    count = V * D + L * per_layer + D + (0 if tied else D * V)
    assert families.fp32_bytes(_cfg(tie_embeddings=tied)) == 4 * count


@pytest.mark.parametrize(
    ("path", "transpose", "fields"),
    [
        ("blocks/00/attn/wk", True, "num_key_value_heads x head_dim, hidden_size"),
        ("blocks/00/attn/wk", False, "hidden_size, num_key_value_heads x head_dim"),
        ("blocks/00/attn_norm/scale", False, "hidden_size"),
        (QKV, True, "sum of wq/wk/wv outputs, hidden_size"),
        (GATE_UP, True, "sum of w_gate/w_up outputs, hidden_size"),
    ],
)
def test_a_shape_names_the_config_fields_it_comes_from_in_hf_order(path, transpose, fields):
    """The refusal of a tensor of the wrong shape names the ``config.json`` fields of each
    dimension, in the stored (HF, ``[out, in]`` for a Linear) order."""
    assert families.shape_fields(path, transpose) == fields
