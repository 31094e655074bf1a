"""LoRA on a quantized frozen base (``model.lora.base_quantization``, docs/quantized-base.md):
the base held as codes on the device, the logits against the unquantized model's within the
measured error, the digests, and the refusals naming file, field and expectation."""

from __future__ import annotations

import json
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file
from test_base_model import _prepare, make_inputs
from test_lora import LORA, ROWS, _logits, lora_recipe
from test_quantize import ref_double, ref_int8, ref_nf4, ref_nf4_back

from minifield import recipe as recipes
from minifield.hf import checkpoint as hf_checkpoint
from minifield.hf import pinned_base, stored_base
from minifield.models.quantize import QuantizedWeight
from minifield.training import lora

# the test base's matrices have 32 or 48 inputs: blocks of 16 divide them all
NF4 = {**LORA, "base_quantization": "nf4", "quantization_block": 16, "double_quantization": True}
INT8 = {**LORA, "base_quantization": "int8"}


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    root = tmp_path_factory.mktemp("qlora") / "in"
    make_inputs(root)
    return root


def _program(root, section, **model):
    loaded, (arrays, _) = _prepare(lora_recipe(root, section, **model), root)
    return loaded.strategy.build(loaded.data, arrays)


def _forwards(section, root, reference_weight=None):
    """The quantized model's logits (B zero: the base model's) and the unquantized model's,
    each block matrix first replaced by ``reference_weight(w)`` when given."""
    program = _program(root, section)
    adapters = program.init_state()["params"]
    params = pinned_base.params_from_arrays(program.arrays)
    if reference_weight is not None:
        for block in params["blocks"].values():
            for group in block.values():
                for name, w in group.items():
                    if np.ndim(w) == 2:
                        group[name] = reference_weight(np.asarray(w)).astype(np.float32)
    params = jax.tree_util.tree_map(jnp.asarray, params)
    ours = _logits(lora.adapted(program._base, adapters, program.lora), program.cfg, ROWS)
    return ours, _logits(params, program.cfg, ROWS)


@pytest.mark.parametrize(("section", "bound"), [(INT8, 0.03), (NF4, 0.35)])
def test_logits_are_the_unquantized_models_within_the_measured_error(root, section, bound):
    """Relative RMS error of the logits; bounds about 1.5 times what was measured on this
    model (int8 per channel 0.0155, NF4 blocks of 16 with double quantization 0.243;
    docs/quantized-base.md)."""
    ours, reference = _forwards(section, root)
    error = np.linalg.norm(ours - reference) / np.linalg.norm(reference)
    assert 0 < error < bound


def _nf4_reference(w_in_out):
    """The float64 NumPy reference's dequantized matrix (test_quantize's, from bitsandbytes'
    definitions): NF4 in blocks of 16 along the inputs, double-quantized scales."""
    w_out_in = w_in_out.T
    packed, absmax, _ = ref_nf4(w_out_in, 16)
    return ref_nf4_back(packed, ref_double(absmax), 16).reshape(w_out_in.shape).T


def _int8_reference(w_in_out):
    codes, absmax, _ = ref_int8(w_in_out.T, w_in_out.shape[0])
    return (codes * absmax[:, None] / 127.0).T


@pytest.mark.parametrize(("section", "reference"), [(INT8, _int8_reference), (NF4, _nf4_reference)])
def test_logits_are_the_models_with_the_reference_dequantized_weights(root, section, reference):
    """Dequantized inside each layer's products: the same model as one whose matrices are the
    NumPy reference's quantize-then-dequantize (a code on a rounding tie aside)."""
    ours, expected = _forwards(section, root, reference)
    np.testing.assert_allclose(ours, expected, rtol=1e-4, atol=1e-4 * np.abs(expected).max())


def test_the_base_is_held_as_codes_and_the_step_trains_the_adapters(root):
    program = _program(root, NF4)
    leaves = jax.tree_util.tree_leaves(
        program._base.params, is_leaf=lambda x: isinstance(x, QuantizedWeight)
    )
    quantized = [w for w in leaves if isinstance(w, QuantizedWeight)]
    assert len(quantized) == 7 * 2  # every matrix of both blocks
    assert all(w.codes.dtype == jnp.uint8 and w.scales.dtype == jnp.int8 for w in quantized)
    state = program.place(program.init_state())
    before = jax.tree_util.tree_map(np.asarray, state["params"])
    for _ in range(2):
        state, metrics = program.step(state)
    assert np.isfinite(float(metrics["loss"]))
    moved = jax.tree_util.tree_map(lambda a, b: not np.array_equal(a, b), before, state["params"])
    assert all(jax.tree_util.tree_leaves(moved))


@pytest.mark.slow  # two programs compiled and trained
def test_the_table_in_the_hosts_memory_trains_the_bits_of_the_table_on_the_device(root):
    """The quantized base's token embedding (its head untied) waits in the host's memory,
    its rows gathered there: three updates and the DEV figures are those of the same program
    with the table placed on the device (a gather is exact). (What it takes off the chip's
    arguments is the chip compiler's to say: ``benchmarks/tpu_compile.py``, docs/tpu.md.)"""
    program, twin = _program(root, NF4), _program(root, NF4)
    assert program._base.host == {"embed/tokens"}
    table = program._base.params["embed"]["tokens"]
    assert table.sharding.memory_kind == "pinned_host"
    base = twin._base
    params = {**base.params, "embed": {"tokens": jax.device_put(np.asarray(table))}}
    twin._base = stored_base.FrozenBase(params, base.out_in, base.dtype)  # no host paths
    states = []
    for run in (program, twin):
        state = run.place(run.init_state())
        for _ in range(3):
            state, _ = run.step(state)
        states.append((state, run.evaluate(state)))
    for a, b in zip(*(jax.tree_util.tree_leaves(s) for s, _ in states), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert states[0][1] == states[1][1]


def test_the_scanned_layers_run_the_same_quantized_model(root):
    """Under ``lax.scan`` (one layer's codes made back at a time) the model is the loop's."""
    program = _program(root, NF4)
    scanned = _program(root, NF4, scan_layers=True)
    adapters = program.init_state()["params"]
    loop = _logits(lora.adapted(program._base, adapters, program.lora), program.cfg, ROWS)
    scan = _logits(lora.adapted(scanned._base, adapters, scanned.lora), scanned.cfg, ROWS)
    np.testing.assert_allclose(scan, loop, rtol=1e-5, atol=1e-5)


@pytest.mark.slow  # a run and its export (2 s); the fast tier keeps the codes and the logits
def test_the_adapter_applies_to_the_unquantized_base(root, tmp_path):
    """The PEFT adapter a quantized run writes, added to the original base file's weights,
    is the merged export (as QLoRA adapters are merged); every other tensor is the file's."""
    program = _program(root, NF4)
    state = program.place(program.init_state())
    for _ in range(2):
        state, _ = program.step(state)
    program.export(state, tmp_path / "export")
    base = load_file(str(root / "base" / "model.safetensors"))
    adapter = load_file(str(tmp_path / "export" / "adapter" / "adapter_model.safetensors"))
    merged = load_file(str(tmp_path / "export" / "model.safetensors"))
    scale = LORA["alpha"] / LORA["rank"]
    for name, w in base.items():
        module = f"base_model.model.{name[: -len('.weight')]}"
        if f"{module}.lora_A.weight" not in adapter:
            np.testing.assert_array_equal(merged[name], w, err_msg=name)
            continue
        a = adapter[f"{module}.lora_A.weight"].astype(np.float64)
        b = adapter[f"{module}.lora_B.weight"].astype(np.float64)
        expected = w.astype(np.float64) + scale * (b @ a)
        assert np.max(np.abs(expected - w)) > 1e-5, name  # the adapter changed it
        np.testing.assert_allclose(merged[name], expected, rtol=1e-6, atol=1e-6, err_msg=name)


def _digest(root, section):
    return recipes.validate(lora_recipe(root, section)).computation_digest


def test_absent_none_and_false_spell_the_same_digest_and_settings_change_it(root):
    plain = _digest(root, LORA)
    assert plain == _digest(root, {**LORA, "base_quantization": "none"})
    assert _digest(root, INT8) == _digest(root, {**INT8, "double_quantization": False})
    digests = {plain, _digest(root, INT8), _digest(root, NF4)}
    digests.add(_digest(root, {**NF4, "double_quantization": False}))
    digests.add(_digest(root, {**NF4, "quantization_block": 32}))
    assert len(digests) == 5


def test_the_frozen_base_identity_follows_the_quantization(root):
    inputs = ["base-config", "base-weights"]
    identity = {
        json.dumps(section): lora.base_identity(
            recipes.validate(lora_recipe(root, section)).data, inputs
        ).tobytes()
        for section in (LORA, INT8, NF4)
    }
    assert len(set(identity.values())) == 3


@pytest.mark.parametrize(
    ("section", "pointer", "needle"),
    [
        (
            {**LORA, "double_quantization": True},
            "/model/lora/double_quantization",
            "base_quantization",
        ),
        ({**LORA, "quantization_block": 16}, "/model/lora/quantization_block", "base_quantization"),
        ({**NF4, "quantization_block": 15}, "/model/lora/quantization_block", "even"),
        ({**LORA, "base_quantization": "int4"}, "/model/lora/base_quantization", "int4"),
    ],
)
def test_bad_quantization_fields_are_named(root, section, pointer, needle):
    with pytest.raises(recipes.RecipeError) as info:
        recipes.validate(lora_recipe(root, section))
    errors = info.value.errors
    assert any(e["path"] == pointer and needle in e["message"] for e in errors), errors


def test_quantization_without_lora_is_refused_by_name(root):
    recipe = lora_recipe(root)
    del recipe["model"]["lora"]
    recipe["model"]["base_quantization"] = "nf4"
    with pytest.raises(recipes.RecipeError) as info:
        recipes.validate(recipe)
    assert any("base_quantization" in e["message"] for e in info.value.errors)


def test_a_block_that_does_not_divide_a_matrix_is_refused_at_prepare(root):
    with pytest.raises(pinned_base.BaseModelError) as info:
        _prepare(lora_recipe(root, {**LORA, "base_quantization": "nf4"}), root)
    message = str(info.value)
    assert "config.json" in message and "model.lora.quantization_block" in message
    assert "block size 64 does not divide the input dimension 32" in message


def test_an_already_quantized_base_is_refused_at_prepare(tmp_path):
    root = tmp_path / "in"
    make_inputs(root)
    config = root / "base" / "config.json"
    hf = json.loads(config.read_text())
    config.write_text(json.dumps({**hf, "quantization_config": {"load_in_4bit": True}}))
    with pytest.raises(pinned_base.BaseModelError) as info:
        _prepare(lora_recipe(root, INT8), root)
    assert "already quantized" in str(info.value) and "model.lora.base_quantization" in str(
        info.value
    )


def test_experts_are_refused_by_name(tmp_path):
    import test_mixtral

    tensors = test_mixtral.mixtral_tensors(test_mixtral.MIXTRAL, seed=3)
    directory = test_mixtral.write_checkpoint(tmp_path / "base", test_mixtral.MIXTRAL, tensors)
    cfg, params, layout = hf_checkpoint.load_stored(directory, 32, "float32")
    problem = stored_base.quantization_problem(
        {"base_quantization": "nf4"}, cfg, {}, params, layout
    )
    assert "mixture of experts" in problem and "model.lora.base_quantization nf4" in problem


def test_a_base_stored_in_another_dtype_is_refused_by_name():
    params = {"blocks": {"00": {"attn": {"wq": np.zeros((64, 32), np.int8)}}}}
    cfg = SimpleNamespace(n_experts=0)
    problem = stored_base.quantization_problem(
        {"base_quantization": "int8"}, cfg, {}, params, {"blocks/00/attn/wq": True}
    )
    assert problem == (
        "tensor blocks/00/attn/wq is stored as int8; model.lora.base_quantization int8 needs a "
        "float32, bfloat16 or float16 base"
    )


def test_a_quantized_products_kernel_enters_the_digest_only_where_it_is_not_xla(root, monkeypatch):
    """``execution.QUANTIZED_KERNELS`` names ``xla`` for the TPU: a TPU recipe's digest is as
    before. Named ``pallas`` (another summation order), the kernel enters the digests of the
    TPU's quantized BF16 recipes, and of no other (FP32 computes with XLA's)."""
    from minifield.models import execution
    from minifield.strategies.base import computation_fields

    def checked(section, **model):
        document = lora_recipe(root, section, **model)
        document["runtime"] = {**document.get("runtime", {}), "backend": "tpu"}
        return recipes.validate(document)

    bf16 = {"compute_dtype": "bfloat16"}
    before = {name: checked(s, **bf16) for name, s in (("plain", LORA), ("nf4", NF4))}
    before["fp32"] = checked(NF4)
    assert "quantized_kernel" not in computation_fields(before["nf4"].data)
    monkeypatch.setitem(execution.QUANTIZED_KERNELS, "tpu", "pallas")
    after = {name: checked(s, **bf16) for name, s in (("plain", LORA), ("nf4", NF4))}
    after["fp32"] = checked(NF4)
    assert computation_fields(after["nf4"].data)["quantized_kernel"] == "pallas"
    assert after["nf4"].computation_digest != before["nf4"].computation_digest
    for name in ("plain", "fp32"):
        assert after[name].computation_digest == before[name].computation_digest
