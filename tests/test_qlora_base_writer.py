"""``benchmarks/qlora_step.py``'s random base, drawn into its files a piece at a time
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
    drawn here tensor by tensor, whole, with the shapes written out by hand and the normal's
    quantiles from SciPy's ``ndtri``."""
    from scipy.special import ndtri

    D, F, V, L = cfg.d_model, cfg.d_ff, cfg.vocab_size, cfg.n_layers
    K = D // cfg.n_heads
    shapes = {"attn/wq": (D, D), "attn/wk": (2 * K, D), "attn/wv": (2 * K, D),
              "attn/wo": (D, D), "mlp/w_gate": (F, D), "mlp/w_up": (F, D),
              "mlp/w_down": (D, F)}  # fmt: skip
    quantiles = ndtri((np.arange(65536) + 0.5) / 65536)
    out = {}

    def normal(key, shape, sigma):
        words = np.random.PCG64(np.random.SeedSequence(key)).random_raw(math.prod(shape))
        # each raw output's four 16-bit words, the low first
        index = np.stack([(words >> np.uint64(16 * j)) & np.uint64(0xFFFF) for j in range(4)], 1)
        index = index.reshape(-1)[: math.prod(shape)].astype(np.int64)
        return (sigma * quantiles[index]).astype(ml_dtypes.bfloat16).reshape(shape)

    out["embed/tokens"] = normal([seed, 0, 0], (V, D), 0.02)
    for i in range(L):
        for place, (_, path) in enumerate(LAYER):
            if path.endswith("scale"):
                out[f"blocks/{i:02d}/{path}"] = np.ones(D, ml_dtypes.bfloat16)
                continue
            shape = shapes[path]
            sigma = shape[1] ** -0.5 / (
                math.sqrt(2 * L) if path in ("attn/wo", "mlp/w_down") else 1
            )
            out[f"blocks/{i:02d}/{path}"] = normal([seed, i + 1, place], shape, sigma)
    out["final_norm/scale"] = np.ones(D, ml_dtypes.bfloat16)
    if not cfg.tie_embeddings:  # the head is the last group's second tensor
        out["head/w"] = normal([seed, L + 1, 1], (V, D), D**-0.5)
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


def test_the_host_holds_less_than_a_layer_while_writing(tmp_path, monkeypatch):
    """12 layers of 2 MB (BF16): the writer holds the value tables and a piece of a tensor a
    thread (4096 values here), never a layer (the writer before this one held a layer and its
    bytes for the file)."""
    cfg = tiny(layers=12, d=256, ff=1024, vocab=256)
    K = 256 // 4
    layer_bf16 = 2 * (2 * 256 * 256 + 2 * 2 * K * 256 + 3 * 256 * 1024 + 2 * 256)
    # a first write imports and caches what it needs (safetensors' header, the config's
    # schema, the standard quantiles): the interpreter's, once, not the writer's per model
    _random_base.write(tmp_path / "warm", tiny(layers=1), seed=0)
    monkeypatch.setattr(_random_base, "DRAW_VALUES", 4096)
    tracemalloc.start()
    try:
        _random_base.write(tmp_path / "base", cfg, seed=0)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    # four tables of 128 KiB, the float64 quantiles scaled for one (512 KiB), the pieces
    assert peak < layer_bf16 < 12 * layer_bf16, (peak, layer_bf16)


@pytest.mark.parametrize(
    ("preset", "parameters"),
    # the published parameter counts (Meta's model cards, the checkpoints' safetensors index)
    [("llama-3.1-8b", 8_030_261_248), ("llama-3.2-3b", 3_212_749_824)],
)
def test_the_presets_are_the_published_shapes(preset, parameters):
    cfg = qlora_step.base_config(SimpleNamespace(preset=preset, seq=2048))
    assert checkpoint.fp32_bytes(cfg) == 4 * parameters
    assert cfg.rope_theta == 500000.0 and cfg.tie_embeddings == (preset == "llama-3.2-3b")


def test_a_tensor_larger_than_a_layer_is_drawn_a_piece_at_a_time(tmp_path, monkeypatch):
    """The embeddings (here 64 layers' values, 4 MiB in BF16): never held whole, not even in
    BF16; and the pieces (4096 values) give the values of the tensor's one stream."""
    cfg = tiny(layers=2, d=64, ff=128, vocab=32768)
    embeddings_bf16 = 2 * 32768 * 64
    _random_base.write(tmp_path / "warm", tiny(layers=1), seed=0)
    monkeypatch.setattr(_random_base, "DRAW_VALUES", 4096)
    tracemalloc.start()
    try:
        _random_base.write(tmp_path / "base", cfg, seed=3, threads=3)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < embeddings_bf16 / 2, (peak, embeddings_bf16)
    _, params, _ = checkpoint.load_stored(tmp_path / "base")
    want = redraw(cfg, 3)
    for path, value in _flat(params):
        assert np.array_equal(np.asarray(value).view(np.uint16), want[path].view(np.uint16)), path
