"""What the families of :mod:`test_families` refuse, each naming the file and the field;
the recipe fields the families added; a family's base model through prepare."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from family_reference import (
    CONFIGS,
    GEMMA,
    GEMMA2,
    GEMMA3,
    MISTRAL,
    PHI3,
    QWEN2,
    QWEN3,
    hf_tensors,
    write_checkpoint,
)

from minifield.hf import checkpoint as hf_checkpoint
from minifield.hf import config as hf_config
from minifield.hf.checkpoint import CheckpointError
from minifield.models.execution import Execution

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
    from minifield.strategies.lm import model_section

    base = {"architecture": "llama", "d_model": 32, "n_layers": 1, "n_heads": 4, "d_ff": 64}
    plain = recipes.validate(_recipe(base))
    assert not {"head_dim", "qk_norm", "sliding_window"} & set(plain.data["model"])
    spelled = recipes.validate(_recipe({**base, "head_dim": 8, "qk_norm": False}))
    assert spelled.computation_digest == plain.computation_digest
    qwen3_like = recipes.validate(_recipe({**base, "head_dim": 12, "qk_norm": True}))
    windowed = recipes.validate(_recipe({**base, "sliding_window": 4}))
    digests = {r.computation_digest for r in (plain, qwen3_like, windowed)}
    assert len(digests) == 3
    cfg = model_section.model_config(qwen3_like.data, vocab_size=260)
    assert (cfg.head_dim, cfg.qk_norm, cfg.sliding_window) == (12, True, None)
    assert model_section.model_config(windowed.data, vocab_size=260).sliding_window == 4
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

    from minifield.hf import pinned_base

    root, _ = _base_of_family(tmp_path, QWEN3)
    _, (arrays, meta) = _prepare(base_recipe(root), root)
    config = meta["base_model"]["config"]
    assert config["qk_norm"] and config["head_dim"] == 12
    assert arrays["base.blocks.01.attn.q_norm"].shape == (12,)
    with pytest.raises(
        pinned_base.BaseModelError, match=r"config.json: head_dim gives head_dim=12"
    ):
        _prepare(base_recipe(root, {"head_dim": 8}), root)


def test_lora_on_a_fused_phi3_base_is_refused_naming_config_json(tmp_path):
    from test_base_model import _prepare, base_recipe

    from minifield.hf import pinned_base

    root, _ = _base_of_family(tmp_path, PHI3)
    with pytest.raises(
        pinned_base.BaseModelError,
        match=rf"^{root / 'base' / 'config.json'}: model_type phi3 stores qkv_proj and "
        "gate_up_proj fused; LoRA",
    ):
        _prepare(base_recipe(root, {"lora": {"rank": 2}}), root)


def test_a_window_the_fused_kernel_cannot_run_is_refused_at_validation_and_prepare(tmp_path):
    from test_base_model import _prepare, base_recipe
    from test_llama import _recipe

    from minifield import recipe as recipes
    from minifield.hf import pinned_base

    section = {"architecture": "llama", "d_model": 32, "n_heads": 4, "attention": "pallas"}
    with pytest.raises(recipes.RecipeError) as info:
        recipes.validate(_recipe({**section, "sliding_window": 4}))
    assert [e["path"] for e in info.value.errors] == ["/model/sliding_window"]
    recipes.validate(_recipe({**section, "sliding_window": 32}))  # no row reaches past it
    root, _ = _base_of_family(tmp_path, MISTRAL)
    with pytest.raises(
        pinned_base.BaseModelError,
        match=rf"^{root / 'base' / 'config.json'}: model.attention pallas: the fused kernel has "
        r"no sliding window, and sliding_window 4 < the rows' 64 positions",
    ):
        _prepare(base_recipe(root, {"attention": "pallas"}), root)
