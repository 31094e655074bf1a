"""LoRA on mixture-of-experts bases: adapters on the experts and the router, their PEFT files,
the merged export, and a killed run resumed.

The references are written here: the tiny Mixtral and Qwen2-MoE checkpoints and float64 NumPy
forwards of ``test_mixtral.py`` / ``test_moe_families.py`` (transformers' equations), run on
the HF tensors with each adapted module's weight replaced by ``W + (alpha / r) * B @ A``, as
PEFT merges an ``nn.Linear``'s adapter; the PEFT names and shapes are written out by hand.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import test_mixtral
import test_moe_families
from conftest import THIS_PROCESS, compiled_as, started_xla_flags, update_hashes, write_recipe
from safetensors.numpy import load_file
from test_base_model import _prepare, _run, base_recipe, make_inputs

from minifield.hf import checkpoint as hf_checkpoint
from minifield.hf import pinned_base
from minifield.models import model
from minifield.models.execution import Execution
from minifield.training import lora, peft_adapter

RANK, ALPHA = 2, 6.0
SCALE = ALPHA / RANK
MIXTRAL_TARGETS = ("q_proj", "v_proj", "w1", "w3", "w2", "gate")
QWEN_TARGETS = ("k_proj", "gate_proj", "up_proj", "down_proj", "gate")
CASES = {
    "mixtral": (test_mixtral, test_mixtral.MIXTRAL, test_mixtral.mixtral_tensors, MIXTRAL_TARGETS),
    "qwen2_moe": (
        test_moe_families,
        test_moe_families.QWEN2_MOE,
        test_moe_families.make_tensors,
        QWEN_TARGETS,
    ),
}


# Qwen2-MoE's case (shared expert, its gate) in the full suite only: the fast tier keeps
# Mixtral's, the same adapters on grouped experts (3.12's fast tier is at its limit)
@pytest.fixture(
    scope="module",
    params=[pytest.param(c, marks=pytest.mark.slow) if c == "qwen2_moe" else c for c in CASES],
)
def case(request, tmp_path_factory):
    """A tiny checkpoint of the family, its loaded parameters, and adapters whose ``B`` are
    random (a fresh adapter's are zeros, which would leave nothing to compare)."""
    module, hf, make, targets = CASES[request.param]
    tensors = make(hf, seed=3)
    directory = module.write_checkpoint(tmp_path_factory.mktemp("moe-lora") / "base", hf, tensors)
    cfg, params = hf_checkpoint.load(directory, max_len=32, compute_dtype="float32")
    settings = lora.LoraSettings(RANK, ALPHA, targets)
    adapters = lora.init_adapters(cfg, settings, jax.random.key(7))
    rng = np.random.default_rng(11)
    adapters = jax.tree_util.tree_map_with_path(
        lambda path, x: (
            jnp.asarray(rng.normal(0, 0.3, x.shape), jnp.float32) if path[-1].key == "b" else x
        ),
        adapters,
    )
    return {
        "module": module,
        "hf": hf,
        "tensors": tensors,
        "cfg": cfg,
        "params": params,
        "settings": settings,
        "adapters": adapters,
    }


def _peft_merged(tensors: dict, adapter: dict) -> dict:
    """The HF tensors with every module PEFT's adapter names merged: W + scale * B @ A."""
    out = {}
    for name, w in tensors.items():
        module = "base_model.model." + name.removesuffix(".weight")
        w = w.astype(np.float64)
        if f"{module}.lora_A.weight" in adapter:
            a = adapter[f"{module}.lora_A.weight"].astype(np.float64)
            b = adapter[f"{module}.lora_B.weight"].astype(np.float64)
            w = w + SCALE * (b @ a)
        out[name] = w
    return out


def _logits(cfg, params, row):
    tokens = jnp.asarray([row], jnp.int32)
    positions = jnp.arange(len(row), dtype=jnp.int32)[None]
    forward = jax.jit(model.forward, static_argnums=1)
    return np.asarray(forward(params, cfg, tokens, jnp.ones_like(tokens), positions))[0]


def test_the_lora_forward_is_the_numpy_forward_of_w_plus_scaled_b_a(case):
    cfg, settings, adapters = case["cfg"], case["settings"], case["adapters"]
    adapter = peft_adapter.peft_tensors(cfg, adapters)
    reference = case["module"].reference_logits(
        _peft_merged(case["tensors"], adapter), case["hf"], case["module"].ROWS[0]
    )
    ours = _logits(cfg, lora.adapted(case["params"], adapters, settings), case["module"].ROWS[0])
    np.testing.assert_allclose(ours, reference, atol=1e-4, rtol=0)
    base = case["module"].reference_logits(case["tensors"], case["hf"], case["module"].ROWS[0])
    assert np.abs(reference - base).max() > 1e-2  # the adapters change the logits
    # the merged FP32 weights compute the same logits
    merged = jax.jit(lambda p, a: lora.merged(p, a, settings))(case["params"], adapters)
    np.testing.assert_allclose(
        _logits(cfg, merged, case["module"].ROWS[0]), reference, atol=1e-4, rtol=0
    )


def test_a_scanned_stack_computes_the_same_lora_logits(case):
    cfg, settings, adapters = case["cfg"], case["settings"], case["adapters"]
    if cfg.dense_layers:
        pytest.skip("a model with dense and sparse layers runs the layer loop only")
    scanned = cfg.__class__(**{**cfg.__dict__, "execution": Execution(scan_layers=True)})
    params = lora.adapted(case["params"], adapters, settings)
    row = case["module"].ROWS[1]
    np.testing.assert_allclose(_logits(scanned, params, row), _logits(cfg, params, row), atol=1e-5)


# -- a LoRA run on a Mixtral base, in process ------------------------------------------------------

L, D, F, E = 2, 32, 24, 4  # test_mixtral.MIXTRAL's layers, hidden, expert width, experts
HK, GK = D, D // 4 * 2  # heads x head_dim, kv heads x head_dim
RUN_TARGETS = ["q_proj", "w1", "w3", "w2", "gate"]

#: the PEFT names and shapes, written out by hand for this model (rank 4)
EXPECTED_ADAPTER = {}
for _i in range(L):
    _modules = {"self_attn.q_proj": (D, HK), "block_sparse_moe.gate": (D, E)}
    for _j in range(E):
        _modules[f"block_sparse_moe.experts.{_j}.w1"] = (D, F)
        _modules[f"block_sparse_moe.experts.{_j}.w3"] = (D, F)
        _modules[f"block_sparse_moe.experts.{_j}.w2"] = (F, D)
    for _module, (_in, _out) in _modules.items():
        EXPECTED_ADAPTER[f"base_model.model.model.layers.{_i}.{_module}.lora_A.weight"] = (4, _in)
        EXPECTED_ADAPTER[f"base_model.model.model.layers.{_i}.{_module}.lora_B.weight"] = (_out, 4)


def mixtral_root(root: Path) -> Path:
    """test_base_model's inputs (chat rows, tokenizer, ChatML template) with a Mixtral base."""
    make_inputs(root)
    hf = {**test_mixtral.MIXTRAL, "vocab_size": 340, "max_position_embeddings": 128}
    test_mixtral.write_checkpoint(root / "base", hf, test_mixtral.mixtral_tensors(hf, seed=5))
    return root


def mixtral_lora_recipe(root: Path, targets=RUN_TARGETS, **model) -> dict:
    section = {"rank": 4, "alpha": 8.0, "targets": list(targets)}
    recipe = base_recipe(root, {"lora": section, "compute_dtype": "float32", **model})
    recipe["training"]["learning_rate"] = 0.05  # so two updates move B visibly
    return recipe


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A LoRA program on the Mixtral base, trained for 2 updates in process, and its export."""
    root = mixtral_root(tmp_path_factory.mktemp("moe-lora-run") / "in")
    loaded, (arrays, _) = _prepare(mixtral_lora_recipe(root), root)
    program = loaded.strategy.build(loaded.data, arrays)
    initial = jax.tree_util.tree_map(np.asarray, program.init_state())
    state = program.place(program.init_state())
    for _ in range(2):
        state, _ = program.step(state)
    export = root.parent / "export"
    program.export(state, export)
    return {"root": root, "program": program, "initial": initial, "state": state, "export": export}


@pytest.mark.slow  # the trained Mixtral LoRA run (~6 s under 3.12); the fast tier keeps its forward
def test_an_update_changes_the_adapters_only(trained):
    initial, state = trained["initial"], trained["state"]
    names = {
        "/".join(str(getattr(k, "key", k)) for k in path): leaf.shape
        for path, leaf in jax.tree_util.tree_leaves_with_path(initial["params"])
    }
    # the experts' adapters stacked [E, in, r] / [E, r, out]; the router's and q's as a matrix
    assert names == {
        **{f"blocks/{i:02d}/attn/wq/a": (D, 4) for i in range(L)},
        **{f"blocks/{i:02d}/attn/wq/b": (4, HK) for i in range(L)},
        **{f"blocks/{i:02d}/moe/router/a": (D, 4) for i in range(L)},
        **{f"blocks/{i:02d}/moe/router/b": (4, E) for i in range(L)},
        **{f"blocks/{i:02d}/moe/experts/{w}/a": (E, D, 4) for i in range(L) for w in ("w_gate", "w_up")},
        **{f"blocks/{i:02d}/moe/experts/{w}/b": (E, 4, F) for i in range(L) for w in ("w_gate", "w_up")},
        **{f"blocks/{i:02d}/moe/experts/w_down/a": (E, F, 4) for i in range(L)},
        **{f"blocks/{i:02d}/moe/experts/w_down/b": (E, 4, D) for i in range(L)},
    }  # fmt: skip
    after = jax.tree_util.tree_map(np.asarray, state["params"])
    for pair in (
        after["blocks"]["00"]["moe"]["experts"]["w_up"],
        after["blocks"]["01"]["attn"]["wq"],
    ):
        assert np.all(np.any(pair["b"] != 0, axis=(-2, -1)))  # every expert's B moved
    # the frozen base is not in the state: the device copy is the prepared bytes, unchanged
    base = trained["program"]._base.params["blocks"]["01"]["moe"]["experts"]["w_up"][2]
    on_disk = load_file(str(trained["root"] / "base" / "model.safetensors"))
    np.testing.assert_array_equal(
        np.asarray(base), on_disk["model.layers.1.block_sparse_moe.experts.2.w3.weight"]
    )


@pytest.mark.slow  # the trained Mixtral LoRA run (~6 s under 3.12); the fast tier keeps its forward
def test_the_adapter_has_peft_names_for_the_experts_and_the_router(trained):
    directory = trained["export"] / "adapter"
    config = json.loads((directory / "adapter_config.json").read_text())
    assert config["target_modules"] == ["q_proj", "w1", "w3", "w2", "gate"]
    assert (config["r"], config["lora_alpha"], config["peft_type"]) == (4, 8.0, "LORA")
    tensors = load_file(str(directory / "adapter_model.safetensors"))
    assert {k: v.shape for k, v in tensors.items()} == EXPECTED_ADAPTER
    assert all(np.any(v) for k, v in tensors.items() if "lora_B" in k)


@pytest.mark.slow  # the trained Mixtral LoRA run (~6 s under 3.12); the fast tier keeps its forward
def test_the_merged_export_minus_the_base_is_the_adapters_product(trained):
    root, export = trained["root"], trained["export"]
    base = load_file(str(root / "base" / "model.safetensors"))
    adapter = load_file(str(export / "adapter" / "adapter_model.safetensors"))
    merged = load_file(str(export / "model.safetensors"))
    assert set(merged) == set(base)
    adapted = 0
    for name, w in base.items():
        module = "base_model.model." + name.removesuffix(".weight")
        if f"{module}.lora_A.weight" not in adapter:  # not a target: the base, bit for bit
            np.testing.assert_array_equal(merged[name], w, err_msg=name)
            continue
        a = adapter[f"{module}.lora_A.weight"].astype(np.float64)
        b = adapter[f"{module}.lora_B.weight"].astype(np.float64)
        delta = merged[name].astype(np.float64) - w.astype(np.float64)
        np.testing.assert_allclose(delta, 2.0 * (b @ a), rtol=0, atol=2e-6, err_msg=name)
        adapted += 1
    assert adapted == L * (2 + 3 * E)  # q_proj and the router, three matrices per expert


@pytest.mark.slow  # test_host_merge's NF4 case checks the same writer in the fast tier
def test_the_host_merge_is_the_jitted_merge_byte_for_byte(trained, tmp_path):
    """Each expert's ``A[j] @ B[j]`` merged on the host into its own stored matrix: the export
    as the one jitted merge wrote it (``test_host_merge``'s code of before), file for file."""
    from test_host_merge import _export_as_before

    _export_as_before(trained["program"], trained["state"], tmp_path / "before")
    for path in sorted((tmp_path / "before").rglob("*")):
        if path.is_file():
            name = path.relative_to(tmp_path / "before")
            assert (trained["export"] / name).read_bytes() == path.read_bytes(), name


@pytest.mark.parametrize(
    ("targets", "needle"),
    [
        (["q_proj", "gate_proj"], "model_type mixtral has no module named gate_proj"),
        (["w1", "up_proj"], "model_type mixtral has no module named up_proj"),
    ],
)
def test_a_target_the_mixture_does_not_have_is_refused_naming_it(tmp_path, targets, needle):
    root = mixtral_root(tmp_path / "in")
    with pytest.raises(
        pinned_base.BaseModelError, match=rf"config.json: {needle}.*model.lora.targets"
    ):
        _prepare(mixtral_lora_recipe(root, targets), root)


def test_expert_and_router_targets_on_a_dense_base_are_refused(tmp_path):
    make_inputs(tmp_path / "in")
    recipe = mixtral_lora_recipe(tmp_path / "in", ["q_proj", "w2", "gate"])
    with pytest.raises(
        pinned_base.BaseModelError, match=r"has no module named w2, gate: model.lora.targets"
    ):
        _prepare(recipe, tmp_path / "in")


# -- through the worker (slow) ------------------------------------------------------------------


@pytest.mark.slow
def test_a_killed_mixtral_lora_run_resumes_bit_identically(tmp_path):
    """A crash after update 3, resumed from the step-2 checkpoint: update 3 recomputed to the
    same state hash, and the run goes on to the end; the checkpoint holds the adapters (the
    experts' stacked), their optimizer state and the base's identity only."""
    root = mixtral_root(tmp_path / "in")
    recipe = mixtral_lora_recipe(root)
    # what is checked is the updates, their state hashes and the files: no greedy decoding in
    # the resumed attempt's final evaluation (it compiled a MoE generation loop for nothing)
    recipe["evaluation"]["max_generate_examples"] = 0
    path = write_recipe(tmp_path / "recipe.json", recipe)
    (crashed,) = _run(tmp_path, path, root, "crash", "--fail-after-step", "3", codes=(1,))
    (_, resumed) = _run(tmp_path, path, root, "crash", "--resume-from", crashed)
    crashed_hashes, resumed_hashes = update_hashes([crashed]), update_hashes([resumed])
    assert sorted(crashed_hashes) == [1, 2, 3] and sorted(resumed_hashes) == [3, 4]
    assert resumed_hashes[3] == crashed_hashes[3]
    result = json.loads((resumed / "result.json").read_text())
    assert result["status"] == "completed" and result["final_state_hash"] == resumed_hashes[4]
    manifest = json.loads((Path(result["checkpoint"]["path"]) / "manifest.json").read_text())
    names = {a["name"] for a in manifest["arrays"] if a["name"].startswith("params/")}
    assert {n for n in names if "/moe/experts/" in n} == {
        f"params/blocks/{i:02d}/moe/experts/{w}/{ab}"
        for i in range(L)
        for w in ("w_gate", "w_up", "w_down")
        for ab in "ab"
    }
    assert (resumed / "export" / "adapter" / "adapter_model.safetensors").is_file()


@pytest.mark.slow
def test_one_and_two_devices_train_a_mixtral_base_alike_full_and_lora(tmp_path):
    """``tests/moe_data_parallel_probe.py`` in a process with 2 host devices: two updates on
    1 device and on 2 with ``shard_params``, full fine-tuning and LoRA on the experts. The
    same rows and the same start; only the order of FP32 additions differs (per-device partial
    sums, then an all-reduce), so update 1's loss agrees to a few ulps and the parameters after
    two updates to FP32 rounding amplified by AdamW's normalisation (``test_data_parallel``'s
    argument): 3e-4, a twentieth of the most two AdamW updates can move a full fine-tune's
    parameter (2 x learning rate 0.003; measured here 5e-5 full, 7e-7 LoRA)."""
    env = {
        **compiled_as(THIS_PROCESS),  # as every process the suite starts: both sides alike
        "JAX_PLATFORMS": "cpu",
        # the session's light flags too (the elemental emitters): both sides in that process
        "XLA_FLAGS": started_xla_flags("--xla_force_host_platform_device_count=2"),
        "PATH": "/usr/bin:/bin",
    }
    probe = Path(__file__).with_name("moe_data_parallel_probe.py")
    proc = subprocess.run(
        [sys.executable, str(probe), str(tmp_path / "in")],
        capture_output=True, text=True, timeout=600, env=env, cwd=Path(__file__).parent,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    for kind in ("full", "lora"):
        run = report[kind]
        one, two = (np.array(x) for x in run["losses"])
        np.testing.assert_allclose(two[0], one[0], rtol=1e-6, err_msg=kind)
        np.testing.assert_allclose(two, one, rtol=1e-5, err_msg=kind)
        assert run["max_param_difference"] <= 3e-4, kind
        assert run["same_start"], kind  # the state created on the mesh: the same bits
        placement = run["placement"]
        assert placement["devices"] == 2 and placement["sharded_arrays"] > 0, kind
    # LoRA: the experts' stacked adapter [E=4, D, r] is split along the experts, 2 per device
    assert report["lora"]["expert_shards"] == [[2, D, 4], [2, D, 4]]
    # full: the experts' stacked matrices [E=4, D, F] split within each expert, along D
    assert report["full"]["expert_shards"] == [[4, D // 2, F], [4, D // 2, F]]
