"""LoRA fine-tuning of a pinned base model (``model.lora``) and its PEFT-format export.

The base model is ``test_base_model``'s: random tensors written under HF names with
``safetensors`` directly. The references here are independent of :mod:`.lora`: the merged
export is checked against ``W + (alpha / rank) * B @ A`` computed in float64 numpy from the
base ``model.safetensors`` and the adapter ``adapter_model.safetensors`` read back with
``safetensors.numpy``; the PEFT key names are written out by hand; the merged model is loaded
by transformers' ``FlaxLlamaForCausalLM`` (``hf-reference`` group) and compared with our
unmerged LoRA forward; resume is compared by the worker's own state hashes, and the frozen
base held as stored by the same run made beside it with the base held as before
(``test_frozen_base``), both on this machine.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import read_events, write_recipe
from safetensors.numpy import load_file
from test_base_model import BASE, _prepare, _run, base_recipe, make_inputs

from minifield import recipe as recipes
from minifield.hf import pinned_base
from minifield.models import model
from minifield.pipeline import evaluation, preparation
from minifield.training import lora

RANK, ALPHA = 4, 8.0
TARGETS = ["q_proj", "v_proj", "o_proj", "down_proj"]  # k_proj, gate_proj, up_proj untouched
LORA = {"rank": RANK, "alpha": ALPHA, "targets": TARGETS}
L, D, F = BASE["num_hidden_layers"], BASE["hidden_size"], BASE["intermediate_size"]
HK = D  # num_attention_heads * head_dim
GK = D // BASE["num_attention_heads"] * BASE["num_key_value_heads"]


def lora_recipe(root, lora_section=LORA, **model):
    recipe = base_recipe(root, {"lora": dict(lora_section), "compute_dtype": "float32", **model})
    recipe["training"]["learning_rate"] = 0.05  # so a few updates move B visibly
    return recipe


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A LoRA program trained for 3 updates in process, and its export."""
    root = tmp_path_factory.mktemp("lora") / "in"
    make_inputs(root)
    loaded, (arrays, _) = _prepare(lora_recipe(root), root)
    program = loaded.strategy.build(loaded.data, arrays)
    initial = program.init_state()
    initial_host = jax.tree_util.tree_map(np.asarray, initial)
    state = program.place(program.init_state())
    for _ in range(3):
        state, _ = program.step(state)
    export = root.parent / "export"
    program.export(state, export)
    return {
        "root": root,
        "loaded": loaded,
        "program": program,
        "initial": initial_host,
        "state": state,
        "export": export,
    }


def _logits(params, cfg, rows):
    tokens = jnp.asarray(rows, jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
    forward = jax.jit(model.forward, static_argnums=1)
    return np.asarray(forward(params, cfg, tokens, jnp.ones_like(tokens), positions))


ROWS = [[1, 5, 7, 9, 11, 13, 2, 60, 3, 3, 40, 17], [66, 0, 4, 8, 15, 16, 23, 42, 8, 1, 9, 30]]

#: the PEFT names and shapes, written out by hand for this model (rank 4; d 32, kv 16, ff 48)
EXPECTED_ADAPTER = {}
for _i in range(L):
    for _module, (_in, _out) in {
        "self_attn.q_proj": (D, HK),
        "self_attn.v_proj": (D, GK),
        "self_attn.o_proj": (HK, D),
        "mlp.down_proj": (F, D),
    }.items():
        EXPECTED_ADAPTER[f"base_model.model.model.layers.{_i}.{_module}.lora_A.weight"] = (4, _in)
        EXPECTED_ADAPTER[f"base_model.model.model.layers.{_i}.{_module}.lora_B.weight"] = (_out, 4)


def test_adapters_start_with_b_zero_so_the_first_forward_is_the_base(trained):
    program, initial = trained["program"], trained["initial"]
    adapters = initial["params"]
    for layer in adapters["blocks"].values():
        for group in layer.values():
            for pair in group.values():
                assert not np.any(pair["b"])
                bound = 1 / np.sqrt(pair["a"].shape[0])  # PEFT's kaiming-uniform(a=sqrt(5))
                assert np.all(np.abs(pair["a"]) <= bound) and np.std(pair["a"]) > bound / 3
    cfg = program.cfg
    # the base as the prepared arrays hold it, widened to FP32 masters on the host
    base_params = jax.tree_util.tree_map(
        jnp.asarray, pinned_base.params_from_arrays(program.arrays)
    )
    ours = _logits(lora.adapted(base_params, adapters, program.lora), cfg, ROWS)
    np.testing.assert_array_equal(ours, _logits(base_params, cfg, ROWS))
    # the state holds the adapters only, and their optimizer state only
    names = {
        "/".join(str(getattr(k, "key", k)) for k in path)
        for path, _ in jax.tree_util.tree_leaves_with_path(initial["params"])
    }
    assert names == {
        f"blocks/{i:02d}/{leaf}/{ab}"
        for i in range(L)
        for leaf in ("attn/wq", "attn/wv", "attn/wo", "mlp/w_down")
        for ab in "ab"
    }
    moments = jax.tree_util.tree_leaves(initial["opt_state"])
    assert sum(a.size for a in moments if a.ndim) == 2 * sum(
        a.size for a in jax.tree_util.tree_leaves(initial["params"])
    )


def test_the_adapter_is_a_peft_directory_with_the_documented_names(trained):
    directory = trained["export"] / "adapter"
    assert {p.name for p in directory.iterdir()} == {
        "adapter_config.json",
        "adapter_model.safetensors",
    }
    config = json.loads((directory / "adapter_config.json").read_text())
    assert {k: config[k] for k in ("peft_type", "task_type", "r", "lora_alpha", "bias")} == {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": 4,
        "lora_alpha": 8.0,
        "bias": "none",
    }
    assert config["target_modules"] == ["q_proj", "v_proj", "o_proj", "down_proj"]
    assert config["fan_in_fan_out"] is False and config["base_model_name_or_path"] == "base"
    tensors = load_file(str(directory / "adapter_model.safetensors"))
    assert {k: v.shape for k, v in tensors.items()} == EXPECTED_ADAPTER
    assert all(v.dtype == np.float32 for v in tensors.values())
    # trained: every B moved away from zero
    assert all(np.any(v) for k, v in tensors.items() if "lora_B" in k)


def test_the_export_is_byte_for_byte_the_one_before_the_frozen_base_change(trained, tmp_path):
    """The base held as stored (:mod:`.stored_base`) changes no bit of the run: the final
    state hash, every state array and every exported file equal those of the same run made
    here, on this machine, with the base held as before that change (FP32 ``[in, out]``
    from the loader). Bits recorded on another machine are no reference: XLA's CPU kernels
    follow the processor (the values once recorded are quoted in ``test_frozen_base``)."""
    from test_frozen_base import assert_the_run_before

    assert_the_run_before(
        trained["loaded"],
        trained["program"],
        trained["root"],
        trained["state"],
        trained["export"],
        tmp_path,
    )


def test_a_sharded_export_has_the_same_tensors_and_one_adapter_file(trained, tmp_path):
    """``evaluation.export_max_shard_size``: the merged model in shards (equal tensor by
    tensor to the single file), the PEFT adapter one file as PEFT writes it (byte for byte)."""
    program = copy.copy(trained["program"])
    evaluation = {**program.recipe["evaluation"], "export_max_shard_size": 6000}
    program.recipe = {**program.recipe, "evaluation": evaluation}
    sharded = tmp_path / "sharded"
    program.export(trained["state"], sharded)
    single = trained["export"]
    shards = sorted(p.name for p in sharded.glob("model-*-of-*.safetensors"))
    assert len(shards) > 2 and not (sharded / "model.safetensors").exists()
    merged = {}
    for name in shards:
        merged.update(load_file(str(sharded / name)))
    whole = load_file(str(single / "model.safetensors"))
    assert merged.keys() == whole.keys()
    for name, value in whole.items():
        np.testing.assert_array_equal(merged[name], value, err_msg=name)
    assert sorted(p.name for p in (sharded / "adapter").iterdir()) == sorted(
        p.name for p in (single / "adapter").iterdir()
    )
    for path in (single / "adapter").iterdir():
        assert (sharded / "adapter" / path.name).read_bytes() == path.read_bytes()


def test_the_merged_export_is_w_plus_scaled_b_times_a_from_the_files(trained):
    root, export = trained["root"], trained["export"]
    base = load_file(str(root / "base" / "model.safetensors"))
    adapter = load_file(str(export / "adapter" / "adapter_model.safetensors"))
    merged = load_file(str(export / "model.safetensors"))
    assert set(merged) == set(base)
    prefix = "base_model.model."
    for name, w in base.items():
        module = name[: -len(".weight")]
        a_key, b_key = f"{prefix}{module}.lora_A.weight", f"{prefix}{module}.lora_B.weight"
        if a_key in adapter:
            a, b = adapter[a_key].astype(np.float64), adapter[b_key].astype(np.float64)
            expected = w.astype(np.float64) + (ALPHA / RANK) * (b @ a)
            assert np.max(np.abs(expected - w)) > 1e-4, name  # the adapter changed it
            np.testing.assert_allclose(merged[name], expected, rtol=1e-6, atol=1e-6, err_msg=name)
        else:  # not a target: the base tensor, bit for bit
            np.testing.assert_array_equal(merged[name], w, err_msg=name)
    recorded = json.loads((export / "model.json").read_text())["config"]["lora"]
    assert recorded["rank"] == RANK and recorded["adapter_dir"] == "adapter"


@pytest.mark.slow
def test_the_merged_export_loads_in_transformers_with_our_lora_logits(trained, flax_rope_theta):
    from test_llama import _flax_model

    export, program = trained["export"], trained["program"]
    hf = json.loads((export / "config.json").read_text())
    flax_rope_theta(hf["rope_theta"])
    reference = _flax_model(export, hf)
    theirs = np.asarray(reference(np.asarray(ROWS, np.int32)).logits)
    # ours: the unmerged LoRA forward (x @ W + scale * (x @ A) @ B) on the trained adapters
    adapted = lora.adapted(program._base, trained["state"]["params"], program.lora)
    np.testing.assert_allclose(_logits(adapted, program.cfg, ROWS), theirs, atol=1e-4)


@pytest.fixture
def flax_rope_theta(monkeypatch):
    from test_llama import flax_rope_theta as fixture

    return fixture.__wrapped__(monkeypatch)


# -- the recipe --------------------------------------------------------------------------------


def _digest(root, section):
    return recipes.validate(lora_recipe(root, section)).computation_digest


def test_lora_settings_are_part_of_the_digest_and_defaults_spell_the_same(tmp_path):
    root = tmp_path / "in"
    make_inputs(root)
    full = recipes.validate(base_recipe(root, {"compute_dtype": "float32"})).computation_digest
    default = _digest(root, {})
    assert default == _digest(root, {"rank": 8, "alpha": 8, "targets": ["v_proj", "q_proj"]})
    assert default == _digest(root, {"base_dtype": "float32"})
    others = {
        full,
        default,
        _digest(root, {"rank": 4}),
        _digest(root, {"alpha": 16}),
        _digest(root, {"targets": ["q_proj"]}),
        _digest(root, {"base_dtype": "bfloat16"}),
    }
    assert len(others) == 6
    # the prepared examples do not depend on LoRA
    examples = {
        recipes.validate(r).examples_digest
        for r in (base_recipe(root, {"compute_dtype": "float32"}), lora_recipe(root))
    }
    assert len(examples) == 1


@pytest.mark.parametrize(
    ("change", "pointer", "needle"),
    [
        ({"targets": ["q_proj", "w_in"]}, "/model/lora/targets/1", "w_in"),
        ({"rank": 0}, "/model/lora/rank", "0"),
        ({"rank": 4096}, "/model/lora/rank", "4096"),
        ({"alpha": 0}, "/model/lora/alpha", "0"),
        ({"targets": []}, "/model/lora/targets", "[]"),
        ({"base_dtype": "float16"}, "/model/lora/base_dtype", "float16"),
        ({"dropout": 0.1}, "/model/lora", "dropout"),
    ],
)
def test_bad_lora_fields_are_named(tmp_path, change, pointer, needle):
    root = tmp_path / "in"
    make_inputs(root)
    with pytest.raises(recipes.RecipeError) as info:
        recipes.validate(lora_recipe(root, {**LORA, **change}))
    errors = info.value.errors
    assert any(e["path"] == pointer and needle in e["message"] for e in errors), errors


def test_lora_without_a_base_model_or_a_llama_model_is_refused(tmp_path):
    root = tmp_path / "in"
    make_inputs(root)
    recipe = lora_recipe(root)
    del recipe["model"]["base"]
    recipe["inputs"] = recipe["inputs"][:3]
    with pytest.raises(recipes.RecipeError) as info:
        recipes.validate(recipe)
    messages = [e["message"] for e in info.value.errors if e["path"] == "/model/lora"]
    assert "LoRA adapts a pinned base model: it needs model.base" in messages
    assert "LoRA needs model.architecture llama" in messages  # gpt, the default without base
    recipe["model"]["architecture"] = "llama"
    with pytest.raises(recipes.RecipeError) as info:
        recipes.validate(recipe)
    assert [e for e in info.value.errors if e["path"] == "/model/lora"] == [
        {"path": "/model/lora", "message": "LoRA adapts a pinned base model: it needs model.base"}
    ]


# -- through the worker (slow) ------------------------------------------------------------------


#: a quantized frozen base (docs/quantized-base.md): blocks of 16 divide the test base's inputs
QUANTIZED = {"base_quantization": "nf4", "quantization_block": 16, "double_quantization": True}


@pytest.mark.slow
@pytest.mark.parametrize("quantization", [{}, QUANTIZED], ids=["bf16", "nf4"])
def test_a_lora_run_trains_only_adapters_and_resumes_bit_identically(tmp_path, quantization):
    """BF16 base and compute: a crash after update 3, resumed from the step-2 checkpoint,
    recomputes update 3 to the same state hash, and runs on to the end. A quantized base
    changes none of it, but DEV: it scores the base as trained (its codes), while the merged
    export, which the store's gate re-evaluates, adds the adapters to the unquantized base."""
    from test_hf_export import bf16_bits

    root = tmp_path / "in"
    make_inputs(root)
    section = {**LORA, "base_dtype": "bfloat16", **quantization}
    recipe = lora_recipe(root, section, compute_dtype="bfloat16")
    path = write_recipe(tmp_path / "recipe.json", recipe)
    (crashed,) = _run(tmp_path, path, root, "crash", "--fail-after-step", "3", codes=(1,))
    (_, resumed) = _run(tmp_path, path, root, "crash", "--resume-from", crashed)
    hashes = [
        {
            e["step"]: e["state_hash"]
            for e in read_events(a / "events.jsonl")
            if e["type"] == "update"
        }
        for a in (crashed, resumed)
    ]
    assert sorted(hashes[0]) == [1, 2, 3] and sorted(hashes[1]) == [3, 4]
    assert hashes[1][3] == hashes[0][3]
    result = json.loads((resumed / "result.json").read_text())
    assert result["status"] == "completed" and result["final_state_hash"] == hashes[1][4]
    # the checkpoint holds the adapters, their optimizer state and the base's identity only
    manifest = json.loads((Path(result["checkpoint"]["path"]) / "manifest.json").read_text())
    names = {a["name"] for a in manifest["arrays"]}
    assert {n for n in names if n.startswith("params/")} == {
        f"params/blocks/{i:02d}/{leaf}/{ab}"
        for i in range(L)
        for leaf in ("attn/wq", "attn/wv", "attn/wo", "mlp/w_down")
        for ab in "ab"
    }
    assert {n.split("/")[0] for n in names} == {
        "params",
        "opt_state",
        "rng",
        "step",
        "cursor",
        "frozen_base",
    }
    # the pipeline's evaluate stage scores the adapter checkpoints (with the base from the
    # prepared examples) and exports the DEV-selected one, which the store's gate re-evaluates
    recipe_json = tmp_path / "validated.json"
    preparation.validate(path, recipe_json, tmp_path / "validation.json")
    preparation.prepare(recipe_json, root, tmp_path / "examples")
    train_result = tmp_path / "train-result.json"
    train_result.write_text(json.dumps({**result, "attempt_dir": str(resumed)}))
    metrics = evaluation.evaluate(
        recipe_json, train_result, tmp_path / "examples", tmp_path / "metrics.json",
        tmp_path / "selected",
    )  # fmt: skip
    assert 4 in [row["step"] for row in metrics["checkpoints"]]
    assert (tmp_path / "selected" / "adapter" / "adapter_model.safetensors").is_file()
    loaded = recipes.load(recipe_json)
    gate = loaded.strategy.evaluate_export(loaded.data, tmp_path / "selected")
    dev = metrics["selected_dev"]
    if quantization:  # DEV scored the base as trained (NF4), the gate the merged export
        assert gate["dev_loss"] != dev["dev_loss"]
        np.testing.assert_allclose(gate["dev_loss"], dev["dev_loss"], rtol=0.05)
    else:
        assert gate["dev_exact_match"] == dev["dev_exact_match"]
        np.testing.assert_allclose(gate["dev_loss"], dev["dev_loss"], rtol=1e-6)
    # only the targets changed: every other tensor of the merged export is the base file's,
    # rounded to the BF16 it was held in (bit patterns computed here with integer numpy)
    base = load_file(str(root / "base" / "model.safetensors"))
    merged = load_file(str(resumed / "export" / "model.safetensors"))
    targets = ("q_proj", "v_proj", "o_proj", "down_proj")
    for name, w in base.items():
        held = (bf16_bits(w).astype(np.uint32) << 16).view(np.float32)
        if any(f".{t}." in name for t in targets):
            assert not np.array_equal(merged[name], held), name
        else:
            np.testing.assert_array_equal(merged[name], held, err_msg=name)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("change", "needle"),
    [
        ({"targets": ["qkv"]}, "/model/lora/targets/0"),
        # refused at prepare: NF4's default block of 64 does not divide the base's 32 inputs
        ({"base_quantization": "nf4"}, "model.lora.quantization_block must divide"),
    ],
)
def test_a_bad_lora_field_ends_the_worker_with_exit_2(tmp_path, change, needle):
    from conftest import run_worker

    root = tmp_path / "in"
    make_inputs(root)
    path = write_recipe(tmp_path / "recipe.json", lora_recipe(root, {**LORA, **change}))
    proc = run_worker(job=path, input_root=root, output_root=tmp_path / "out", check_codes=(2,))
    assert needle in proc.stderr + proc.stdout
    assert "Traceback" not in proc.stderr
