"""``benchmarks/qlora_step.py``'s random base, written one layer at a time
(``benchmarks/_random_base.py``): what the project's loader reads back is the documented
per-layer draw, bit for bit; the host's largest allocation is about one layer, not the
model; the presets are the published models' shapes."""

from __future__ import annotations

import json
import math
import sys
import tracemalloc
from types import SimpleNamespace

import ml_dtypes
import numpy as np
import pytest
from conftest import REPO

from minifield.hf import checkpoint
from minifield.models.llama_config import LlamaConfig

sys.path.insert(0, str(REPO / "benchmarks"))
try:
    import _random_base
    import qlora_step
finally:
    sys.path.remove(str(REPO / "benchmarks"))

#: a layer's tensors in the order HF's LlamaDecoderLayer registers them (its state_dict)
LAYER = [
    ("self_attn.q_proj.weight", "attn/wq"),
    ("self_attn.k_proj.weight", "attn/wk"),
    ("self_attn.v_proj.weight", "attn/wv"),
    ("self_attn.o_proj.weight", "attn/wo"),
    ("mlp.gate_proj.weight", "mlp/w_gate"),
    ("mlp.up_proj.weight", "mlp/w_up"),
    ("mlp.down_proj.weight", "mlp/w_down"),
    ("input_layernorm.weight", "attn_norm/scale"),
    ("post_attention_layernorm.weight", "mlp_norm/scale"),
]


def tiny(layers=3, d=32, ff=64, vocab=96, tied=False) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=vocab, d_model=d, n_layers=layers, n_heads=4, n_kv_heads=2, d_ff=ff,
        max_len=16, tie_embeddings=tied,
    )  # fmt: skip


def redraw(cfg, seed):
    """Internal path -> the BF16 tensor (HF ``[out, in]``) the module's docstring defines,
    drawn here group by group with the shapes written out by hand."""
    D, F, V, L = cfg.d_model, cfg.d_ff, cfg.vocab_size, cfg.n_layers
    K = D // cfg.n_heads
    shapes = {"attn/wq": (D, D), "attn/wk": (2 * K, D), "attn/wv": (2 * K, D),
              "attn/wo": (D, D), "mlp/w_gate": (F, D), "mlp/w_up": (F, D),
              "mlp/w_down": (D, F)}  # fmt: skip
    out = {}

    def normal(rng, shape, sigma):
        return (rng.standard_normal(shape, dtype=np.float32) * np.float32(sigma)).astype(
            ml_dtypes.bfloat16
        )

    out["embed/tokens"] = normal(np.random.default_rng([seed, 0]), (V, D), 0.02)
    for i in range(L):
        rng = np.random.default_rng([seed, i + 1])
        for _, path in LAYER:
            if path.endswith("scale"):
                out[f"blocks/{i:02d}/{path}"] = np.ones(D, ml_dtypes.bfloat16)
                continue
            shape = shapes[path]
            sigma = shape[1] ** -0.5 / (
                math.sqrt(2 * L) if path in ("attn/wo", "mlp/w_down") else 1
            )
            out[f"blocks/{i:02d}/{path}"] = normal(rng, shape, sigma)
    out["final_norm/scale"] = np.ones(D, ml_dtypes.bfloat16)
    if not cfg.tie_embeddings:  # the final norm draws nothing: the head is the group's first
        out["head/w"] = normal(np.random.default_rng([seed, L + 1]), (V, D), D**-0.5)
    return out


def _flat(tree, prefix=""):
    for key, value in tree.items():
        if isinstance(value, dict):
            yield from _flat(value, f"{prefix}{key}/")
        else:
            yield f"{prefix}{key}", value


@pytest.mark.parametrize("tied", [False, True])
def test_the_written_base_loads_as_the_per_layer_draw_bit_for_bit(tmp_path, tied):
    cfg = tiny(tied=tied)
    _random_base.write(tmp_path, cfg, seed=7)
    loaded_cfg, params, layout = checkpoint.load_stored(tmp_path)
    assert (loaded_cfg.n_layers, loaded_cfg.tie_embeddings) == (3, tied)
    got = dict(_flat(params))
    want = redraw(cfg, 7)
    assert sorted(got) == sorted(want)
    for path, value in got.items():
        assert value.dtype == ml_dtypes.bfloat16, path
        assert np.array_equal(np.asarray(value).view(np.uint16), want[path].view(np.uint16)), path
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))  # one shard per group
    assert files == [f"model-{g:05d}-of-00005.safetensors" for g in range(1, 6)]
    assert index["weight_map"]["model.layers.1.mlp.down_proj.weight"] == files[2]
    total = sum(v.size for v in want.values())
    assert index["metadata"] == {"total_parameters": total, "total_size": 2 * total}


def test_the_host_holds_about_one_layer_while_writing(tmp_path):
    # 12 layers, the embeddings smaller than a layer: the model is 12 layers' bytes and more
    cfg = tiny(layers=12, d=64, ff=256, vocab=64)
    K = 64 // 4
    layer_bf16 = 2 * (2 * 64 * 64 + 2 * 2 * K * 64 + 3 * 64 * 256 + 2 * 64)
    model_bf16 = 12 * layer_bf16 + 2 * (2 * 64 * 64 + 64)
    # a first write imports and caches what it needs (safetensors' writer, the config's
    # schema): the interpreter's, once, not the writer's per model
    _random_base.write(tmp_path / "warm", tiny(layers=1), seed=0)
    tracemalloc.start()
    try:
        _random_base.write(tmp_path / "base", cfg, seed=0)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    # a layer in BF16, its bytes for the file, the file's bytes, one FP32 matrix being drawn,
    # and the interpreter's own small allocations (well under one layer here)
    assert peak < 4 * layer_bf16 + 64 * 1024 < model_bf16 / 2, (peak, layer_bf16, model_bf16)


@pytest.mark.parametrize(
    ("preset", "parameters"),
    # the published parameter counts (Meta's model cards, the checkpoints' safetensors index)
    [("llama-3.1-8b", 8_030_261_248), ("llama-3.2-3b", 3_212_749_824)],
)
def test_the_presets_are_the_published_shapes(preset, parameters):
    cfg = qlora_step.base_config(SimpleNamespace(preset=preset, seq=2048))
    assert checkpoint.fp32_bytes(cfg) == 4 * parameters
    assert cfg.rope_theta == 500000.0 and cfg.tie_embeddings == (preset == "llama-3.2-3b")


def test_a_tensor_larger_than_a_layer_is_drawn_a_block_at_a_time(tmp_path, monkeypatch):
    """The embeddings' group (here 8 layers' values): the host holds it in BF16 and its bytes
    for the file, never its FP32 draw whole (a 16 KiB block at a time here)."""
    cfg = tiny(layers=2, d=64, ff=128, vocab=4096)
    embeddings_bf16 = 2 * 4096 * 64
    _random_base.write(tmp_path / "warm", tiny(layers=1), seed=0)
    monkeypatch.setattr(_random_base, "DRAW_VALUES", 4096)
    tracemalloc.start()
    try:
        _random_base.write(tmp_path / "base", cfg, seed=3)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    # the whole FP32 draw beside its BF16 copy would be 3 times the BF16 bytes
    assert peak < 2 * embeddings_bf16 + 64 * 1024, (peak, embeddings_bf16)
    _, params, _ = checkpoint.load_stored(tmp_path / "base")
    want = redraw(cfg, 3)
    for path, value in _flat(params):
        assert np.array_equal(np.asarray(value).view(np.uint16), want[path].view(np.uint16)), path
