"""config.json read field by field, each checked for type; the class chosen by model_type;
non-finite base tensors refused. Each refusal names the file and the field (or tensor)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from test_base_model import _prepare, base_recipe
from test_base_model import root as root  # noqa: F401 - the fixture
from test_llama import LLAMA, _broken

from minifield.hf import checkpoint as hf_checkpoint
from minifield.hf import config as hf_config
from minifield.hf import pinned_base
from minifield.hf.checkpoint import CheckpointError


@pytest.mark.parametrize(
    "config, message",
    [
        ([LLAMA], "expected a JSON object, found a list"),
        ("llama", "expected a JSON object, found a string"),
        ({**LLAMA, "rope_scaling": "linear"}, "rope_scaling must be an object, found a string"),
        ({**LLAMA, "hidden_size": "32"}, "hidden_size must be a positive integer, found a string"),
        ({**LLAMA, "num_hidden_layers": 2.0}, "num_hidden_layers must be a positive integer, fo"),
        ({**LLAMA, "tie_word_embeddings": "no"}, "tie_word_embeddings must be a boolean, found a "),
        ({**LLAMA, "rope_theta": [1.0]}, "rope_theta must be a number, found a list"),
        ({**LLAMA, "architectures": "LlamaForCausalLM"}, "architectures must be a list of strin"),
        ({**LLAMA, "hidden_act": None, "mlp_bias": 1}, "mlp_bias must be a boolean, found an int"),
        ({**LLAMA, "sliding_window": "4k"}, "sliding_window must be an integer, found a string"),
        ({**LLAMA, "model_type": 7}, "model_type must be a string, found an integer 7"),
        ({k: v for k, v in LLAMA.items() if k != "vocab_size"}, "missing key 'vocab_size'"),
        (
            {k: v for k, v in LLAMA.items() if k not in ("model_type", "architectures")},
            "neither model_type nor architectures",
        ),
        # transformers builds a GPT-NeoX model from this: refused, naming both
        (
            {**LLAMA, "model_type": "gpt_neox"},
            r"model_type 'gpt_neox' contradicts architectures \['LlamaForCausalLM'\]",
        ),
        (
            {**LLAMA, "model_type": "qwen2"},
            r"model_type 'qwen2' contradicts architectures \['LlamaForCausalLM'\] \(a 'llama'",
        ),
        (
            {k: v for k, v in LLAMA.items() if k != "architectures"} | {"model_type": "gpt_neox"},
            "model_type 'gpt_neox' is not supported",
        ),
    ],
)
def test_a_bad_config_json_is_refused_naming_the_file_and_field(tmp_path, config, message):
    directory = _broken(tmp_path)
    (directory / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=f"^{directory / 'config.json'}: {message}"):
        hf_checkpoint.load(directory)


def test_the_class_is_chosen_by_model_type_without_architectures():
    bare = {k: v for k, v in LLAMA.items() if k != "architectures"}
    assert hf_config.config_from_hf(bare) == hf_config.config_from_hf(LLAMA)
    qwen2 = {**bare, "model_type": "qwen2"}
    assert hf_config.config_from_hf(qwen2).qkv_bias  # Qwen2's q/k/v biases, by model_type
    # a config of an older writer without model_type is read by its architectures entry
    old = {k: v for k, v in LLAMA.items() if k != "model_type"}
    assert hf_config.config_from_hf(old) == hf_config.config_from_hf(LLAMA)


def test_null_reads_as_absent_as_transformers_writes_it():
    nulls = {**LLAMA, "rope_scaling": None, "sliding_window": None, "head_dim": None}
    assert hf_config.config_from_hf(nulls) == hf_config.config_from_hf(LLAMA)


@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf])
def test_a_non_finite_base_tensor_is_refused_naming_the_file_and_tensor(tmp_path, value):
    name = "model.layers.1.self_attn.k_proj.weight"

    def poison(tensors):
        tensors[name][3, 5] = value
        tensors[name][0, 0] = value

    directory = _broken(tmp_path, edit=poison)
    with pytest.raises(
        CheckpointError,
        match=f"^{directory / 'model.safetensors'}: tensor {name} holds 2 non-finite values",
    ):
        hf_checkpoint.load(directory)


@pytest.mark.parametrize("name", ["lm_head.weight", "model.embed_tokens.weight"])
def test_a_non_finite_value_in_the_last_block_of_a_tensor_is_found(tmp_path, name):
    """The check runs block by block as the tensor is widened (16 rows at a time where it is
    transposed): the last, partial block of the untied head's 67 rows is checked too."""

    def poison(tensors):
        tensors[name][66, 31] = np.nan

    directory = _broken(tmp_path, edit=poison)
    with pytest.raises(CheckpointError, match=f"tensor {name} holds 1 non-finite values"):
        hf_checkpoint.load(directory)


def test_a_non_finite_base_model_is_a_bad_input_naming_the_pinned_file(root):  # noqa: F811
    from safetensors.numpy import load_file, save_file

    weights = root / "base" / "model.safetensors"
    tensors = load_file(weights)
    tensors["model.norm.weight"][7] = np.nan
    save_file(tensors, str(weights), {"format": "pt"})
    # BaseModelError is an InputError: the worker's exit 2 (the path
    # test_base_model's worker test takes for a bad shape)
    with pytest.raises(pinned_base.BaseModelError) as info:
        _prepare(base_recipe(root), root)
    assert str(info.value) == (
        f"{weights}: tensor model.norm.weight holds 1 non-finite values (NaN or infinity); "
        "a model cannot train from it"
    )


def test_a_config_json_list_is_a_bad_input_naming_the_pinned_file(root):  # noqa: F811
    config = root / "base" / "config.json"
    config.write_text(json.dumps([json.loads(config.read_text())]))
    with pytest.raises(pinned_base.BaseModelError) as info:
        _prepare(base_recipe(root), root)
    assert str(info.value) == f"{config}: expected a JSON object, found a list"


def _list_config(root):
    config = root / "base" / "config.json"
    config.write_text(json.dumps([json.loads(config.read_text())]))
    return f"{config}: expected a JSON object, found a list"


def _nan_tensor(root):
    from safetensors.numpy import load_file, save_file

    weights = root / "base" / "model.safetensors"
    tensors = load_file(weights)
    tensors["model.norm.weight"][0] = np.inf
    save_file(tensors, str(weights), {"format": "pt"})
    return f"{weights}: tensor model.norm.weight holds 1 non-finite values (NaN or infinity)"


def _gpt_neox(root):
    config = root / "base" / "config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "model_type": "gpt_neox"}))
    return f"{config}: model_type 'gpt_neox' contradicts architectures ['LlamaForCausalLM']"


def _template_bomb(root):
    config = root / "base" / "tokenizer_config.json"
    settings = json.loads(config.read_text())
    config.write_text(json.dumps({**settings, "chat_template": "{{ 'x' * 10000000 }}"}))
    return (
        f"{root / 'sft' / 'train.jsonl'}:1: {config}: chat_template exceeds its "
        "bounds: a repetition (*) would build 10,000,000 characters"
    )


@pytest.mark.slow
@pytest.mark.parametrize("spoil", [_list_config, _nan_tensor, _gpt_neox, _template_bomb])
def test_a_bad_base_model_is_exit_2_in_the_worker_with_one_line(root, tmp_path, spoil):  # noqa: F811
    from conftest import read_events, run_worker, write_recipe

    expected = spoil(root)
    path = write_recipe(tmp_path / "recipe.json", base_recipe(root))
    proc = run_worker(job=path, input_root=root, output_root=tmp_path / "out", check_codes=(2,))
    (attempt,) = (tmp_path / "out" / "base-test").iterdir()
    result = json.loads((attempt / "result.json").read_text())
    assert result["status"] == "failed" and result["error"]["phase"] == "examples"
    assert result["error"]["message"].startswith(expected)
    assert "Traceback" not in proc.stderr
    assert [line for line in proc.stderr.splitlines() if expected in line]
    assert not [e for e in read_events(attempt / "events.jsonl") if e["type"] == "update"]
