"""The three public loads of a model's weights give exactly the bits that were written:
``minifield.load_model`` on an HF directory, the start of a full fine-tune from a prepared base,
and an export's load (``ExportedModel``: the evaluate stage's harness and the store's gate).

The reference is the file itself, read with the ``safetensors`` library's NumPy API, and the
HF-to-internal mapping written here by hand (PyTorch's ``[out, in]`` Linear weights held
``[in, out]``); values are compared as bits, so -0.0, subnormals and the largest finite
values count. Weights in F32 (the loads' pass-through path) and F16 (the widening path).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jax
import numpy as np
import optax
import pytest
from family_reference import hf_tensors
from safetensors.numpy import load_file, save_file
from test_llama import LLAMA

import minifield
from minifield.data import tokenizer as tokenizers
from minifield.digest import sha256_bytes
from minifield.hf import checkpoint as hf_checkpoint
from minifield.hf import directory as hf_directory
from minifield.hf import pinned_base, stored_base
from minifield.inputs import examples
from minifield.state import export
from minifield.strategies.lm.export_format import ExportedModel
from minifield.training.initial_state import state_from_params

HF = {**LLAMA, "vocab_size": 300, "intermediate_size": 40}  # the byte tokenizer's ids fit


def _by_hand(hf: dict) -> dict[str, tuple[str, bool]]:
    """HF name -> (internal path, transposed) of a Llama checkpoint."""
    out = {
        "model.embed_tokens.weight": ("embed/tokens", False),
        "model.norm.weight": ("final_norm/scale", False),
        "lm_head.weight": ("head/w", True),
    }
    for i in range(hf["num_hidden_layers"]):
        p, q = f"model.layers.{i}.", f"blocks/{i:02d}/"
        out[p + "input_layernorm.weight"] = (q + "attn_norm/scale", False)
        out[p + "post_attention_layernorm.weight"] = (q + "mlp_norm/scale", False)
        for hf_name, ours in (("q", "wq"), ("k", "wk"), ("v", "wv"), ("o", "wo")):
            out[p + f"self_attn.{hf_name}_proj.weight"] = (q + f"attn/{ours}", True)
        for hf_name, ours in (("gate", "w_gate"), ("up", "w_up"), ("down", "w_down")):
            out[p + f"mlp.{hf_name}_proj.weight"] = (q + f"mlp/{ours}", True)
    return out


def _write_hf(directory: Path, dtype) -> dict[str, np.ndarray]:
    """An HF directory (weights, config, the byte tokenizer's files); returns the tensors as
    the file holds them, read back with the safetensors library."""
    tensors = {k: v.astype(dtype) for k, v in hf_tensors(HF, seed=3).items()}
    edge = tensors["model.layers.1.mlp.down_proj.weight"]  # values whose bits are easy to lose
    info = np.finfo(dtype)
    edge[0, :4] = [-0.0, info.smallest_subnormal, -info.max, info.max]
    directory.mkdir()
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    torch_dtype = {np.float32: "float32", np.float16: "float16"}[dtype]
    (directory / "config.json").write_text(json.dumps({**HF, "torch_dtype": torch_dtype}))
    (directory / "tokenizer.json").write_bytes(hf_directory.byte_tokenizer_json())
    config = hf_directory.tokenizer_config(tokenizers.byte_tokenizer(), 64)
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return load_file(str(directory / "model.safetensors"))


def _assert_bits_equal(params: dict, written: dict[str, np.ndarray]) -> None:
    """Every parameter is the written tensor widened exactly (FP32), in this project's layout."""
    mapping = _by_hand(HF)
    assert set(mapping) == set(written)
    for name, (path, transposed) in mapping.items():
        node = params
        for part in path.split("/"):
            node = node[part]
        value = np.asarray(node)
        expected = written[name].astype(np.float32)  # exact for F16 and F32
        expected = np.ascontiguousarray(expected.T if transposed else expected)
        assert value.dtype == np.float32 and value.shape == expected.shape, name
        assert np.array_equal(value.view(np.uint32), expected.view(np.uint32)), name


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_load_model_gives_the_bits_written(tmp_path, dtype):
    written = _write_hf(tmp_path / "model", dtype)
    _assert_bits_equal(minifield.load_model(tmp_path / "model").params, written)


def _write_export(directory: Path) -> Path:
    """An export of the HF directory: its files, a DEV copy, ``model.json`` listing them."""
    out = directory.parent / "export"
    shutil.copytree(directory, out)
    (out / "dev.jsonl").write_bytes(b"")
    cfg = hf_checkpoint.config_from_hf(HF, compute_dtype="float32")
    config = {
        "strategy": {"name": "packed-sft", "version": "12.0.0"},
        "model": cfg.to_dict(),
        "tokenizer": {"kind": "byte", "vocab_size": 260},
        "layout": "<bos> prompt <sep> response <eos>",
        "dev": {"file": "dev.jsonl", "sha256": sha256_bytes(b"")},
        "weights": {"format": hf_directory.WEIGHTS_FORMAT, "dtype": "float32"},
    }
    export.write_files(out, config)
    return out


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_an_export_loads_the_bits_written(tmp_path, dtype):
    written = _write_hf(tmp_path / "model", dtype)
    model = ExportedModel(_write_export(tmp_path / "model"))
    _assert_bits_equal(model.params, written)


@pytest.mark.parametrize("where", ["data", "header"])
def test_an_export_whose_weights_changed_is_refused_by_their_sha256(tmp_path, where):
    """The weights' sha256 is checked while they load (on a thread of its own): a changed
    byte is named as a sha256 mismatch, also where the change breaks the file's header first."""
    _write_hf(tmp_path / "model", np.float32)
    out = _write_export(tmp_path / "model")
    weights = out / "model.safetensors"
    data = bytearray(weights.read_bytes())
    at = len(data) - 5 if where == "data" else 9  # the last value's bytes, or the JSON header
    data[at] ^= 0x01
    weights.write_bytes(bytes(data))
    with pytest.raises(export.ExportError, match=f"^{weights}: sha256 mismatch with"):
        ExportedModel(out)


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_a_full_fine_tune_starts_from_the_bits_written(tmp_path, dtype):
    """The prepared base (as the prepare stage stores it), verified and read back as a full
    fine-tune's FP32 masters, on the host and in the step-0 state."""
    written = _write_hf(tmp_path / "model", dtype)
    _, params, layout = hf_checkpoint.load_stored(tmp_path / "model")
    examples.write(tmp_path / "prepared", stored_base.to_arrays(params, layout), {}, "")
    arrays, _ = examples.load(tmp_path / "prepared")
    host = pinned_base.params_from_arrays(arrays)
    _assert_bits_equal(host, written)
    state = state_from_params(host, optax.sgd(0.1), seed=0)
    _assert_bits_equal(jax.device_get(state["params"]), written)
    # the state may hold the host arrays without a copy: a step that donates it must leave
    # them as they were (a resumed or re-created start reads them again)
    step = jax.jit(lambda s: jax.tree_util.tree_map(lambda x: x + 1, s), donate_argnums=0)
    jax.block_until_ready(step(state["params"]))
    _assert_bits_equal(host, written)


def test_prepared_examples_name_the_first_changed_file(tmp_path):
    """The prepared files are hashed side by side; the error names the first changed one in
    the manifest's order."""
    arrays = {f"a{i}": np.full(1000 + i, i, np.int32) for i in range(6)}
    examples.write(tmp_path, arrays, {}, "")
    for i in (4, 2):
        path = tmp_path / f"a{i}.npy"
        path.write_bytes(path.read_bytes()[:-1] + b"\x07")
    with pytest.raises(examples.ExamplesError, match=f"^{tmp_path / 'a2.npy'}: missing or sha256"):
        examples.load(tmp_path)
