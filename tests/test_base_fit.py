"""What a pinned base's ``config.json`` alone refuses, before any tensor is read
(``minifield.hf.base_fit``, docs/quantized-base.md): a quantization the base's layers or widths
cannot take, and a step above ``runtime.device_memory_bytes``; one line naming the file, the
key and the figure, exit 2 from ``minifield validate --input-root`` and from prepare."""

from __future__ import annotations

import json
from types import SimpleNamespace

import family_reference
import pytest
from conftest import REPO, attempts_of, run_attempt, write_recipe
from test_base_model import _prepare, make_inputs
from test_lora import LORA, lora_recipe
from test_mixtral import MIXTRAL
from test_moe_families import FAMILIES as MOE

from minifield import recipe as recipes
from minifield.commands import validate
from minifield.hf import checkpoint as hf_checkpoint
from minifield.hf import pinned_base, stored_base
from minifield.hf.config import config_from_hf
from minifield.models import families

LLAMA = {**family_reference.BASE, "architectures": ["LlamaForCausalLM"], "model_type": "llama"}
DENSE = {"llama": LLAMA, **family_reference.CONFIGS}
EXPERTS = {"mixtral": MIXTRAL, **MOE}


def _problem(hf: dict, section: dict):
    cfg = config_from_hf(hf, "config.json", 16, "float32")
    return stored_base.config_quantization_problem(section, cfg, hf)


def test_every_family_the_project_reads_is_covered_here():
    model_types = {hf["model_type"] for hf in [*DENSE.values(), *EXPERTS.values()]}
    assert model_types == set(families.FAMILIES)


@pytest.mark.parametrize("name", sorted(DENSE))
def test_every_dense_family_has_only_matrices_the_quantizer_knows(name):
    # int8 per output channel: one block whatever the input, so only the layers can refuse
    assert _problem(DENSE[name], {"base_quantization": "int8"}) is None


@pytest.mark.parametrize("model_type", sorted(EXPERTS))
def test_experts_are_refused_by_model_type(model_type):
    problem = _problem(EXPERTS[model_type], {"base_quantization": "nf4"})
    assert problem.startswith(f"model_type {model_type} is a mixture of experts: ")
    assert "model.lora.base_quantization nf4" in problem and "\n" not in problem


def test_a_layer_matrix_the_quantizer_does_not_know_is_refused_by_model_type(monkeypatch):
    monkeypatch.setattr(stored_base, "QUANTIZED_MATRICES", ("wq", "wk", "wv", "wo"))
    problem = _problem(LLAMA, {"base_quantization": "int8"})
    assert problem == (
        "model_type llama: the layer's tensor model.layers.0.mlp.gate_proj.weight is not a "
        "matrix model.lora.base_quantization int8 knows (it quantizes wq, wk, wv, wo)"
    )


def test_a_width_the_block_does_not_divide_is_named_with_its_figure():
    # hidden 32, intermediate 40: blocks of 16 divide q, k, v, o, gate and up's 32 inputs, not
    # down's 40 (HF's down_proj [32, 40]: 40 inputs)
    problem = _problem(LLAMA, {"base_quantization": "nf4", "quantization_block": 16})
    assert problem == (
        "tensor blocks/00/mlp/w_down [40, 32]: block size 16 does not divide the input "
        "dimension 40; model.lora.quantization_block must divide every quantized matrix's "
        "input dimension"
    )


def test_the_vocabulary_is_not_quantized_so_any_vocabulary_is_taken():
    # vocabulary 61 (prime): embeddings and head stay as stored; blocks of 8 divide 32 and 40
    assert LLAMA["vocab_size"] == 61
    assert _problem(LLAMA, {"base_quantization": "nf4", "quantization_block": 8}) is None


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    root = tmp_path_factory.mktemp("fit") / "in"
    make_inputs(root)
    return root


def _never(*args, **kwargs):
    raise AssertionError("read before the refusal")


def test_prepare_refuses_from_config_json_before_reading_data_or_weights(root, monkeypatch):
    monkeypatch.setattr(hf_checkpoint, "load_stored", _never)
    monkeypatch.setattr(pinned_base, "tokenizer_from_files", _never)
    with pytest.raises(pinned_base.BaseModelError) as info:
        _prepare(lora_recipe(root, {**LORA, "base_quantization": "nf4"}), root)
    message = str(info.value)
    assert message.startswith(str(root / "base" / "config.json") + ": tensor blocks/00/attn/wq")
    assert "block size 64 does not divide the input dimension 32" in message


def _memory_recipe(root, limit):
    recipe = lora_recipe(root)
    recipe["runtime"] = {"device_memory_bytes": limit}
    return recipe


def test_the_device_memory_key_is_not_in_the_computation_digest(root):
    plain = recipes.validate(lora_recipe(root)).computation_digest
    assert recipes.validate(_memory_recipe(root, 10**6)).computation_digest == plain


def _validate(job, root) -> int:
    """``minifield validate JOB --input-root ROOT``'s command (not ``cli.main``, whose
    ``accelerator.keep_off`` would change this test process's environment for later tests)."""
    return validate.run(SimpleNamespace(recipe=job, input_root=root))


def test_validate_with_inputs_refuses_a_step_above_the_device_memory(root, tmp_path, capsys):
    job = write_recipe(tmp_path / "recipe.json", _memory_recipe(root, 10**6))
    assert _validate(job, root) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err
    assert err.startswith(f"minifield validate: {root / 'base' / 'config.json'}: the step needs")
    assert "above runtime.device_memory_bytes 0.00 GB" in err


def test_a_step_within_the_device_memory_is_taken(root, tmp_path):
    job = write_recipe(tmp_path / "recipe.json", _memory_recipe(root, 10**12))
    assert _validate(job, root) == 0


@pytest.mark.slow  # starts the worker
def test_the_worker_refuses_the_step_with_exit_2_and_trains_nothing(root, tmp_path):
    job = write_recipe(tmp_path / "recipe.json", _memory_recipe(root, 10**6))
    run_attempt(job, root, tmp_path / "out", codes=(2,))
    (attempt,) = attempts_of(tmp_path / "out", "base-test")
    result = json.loads((attempt / "result.json").read_text())
    assert result["status"] == "failed" and result["steps_completed"] == 0
    assert result["error"]["phase"] == "examples"
    message = result["error"]["message"]
    assert message.startswith(f"{root / 'base' / 'config.json'}: the step needs an estimated ")
    assert "above runtime.device_memory_bytes 0.00 GB" in message


@pytest.mark.parametrize(
    ("shipped", "words"),
    [("linear-demo.yaml", "linear-momentum without"), ("sft-demo.yaml", "packed-sft without")],
)
def test_the_device_memory_key_is_refused_where_nothing_checks_it(shipped, words):
    document = recipes.read_document(REPO / "config" / "recipes" / shipped)
    document.setdefault("runtime", {})["device_memory_bytes"] = 16_909_336_064
    with pytest.raises(recipes.RecipeError) as info:
        recipes.validate(document)
    (error,) = info.value.errors
    assert error["path"] == "/runtime/device_memory_bytes"
    assert f"{words} model.base checks nothing against it" in error["message"]
