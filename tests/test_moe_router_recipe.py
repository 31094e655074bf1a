"""The router's training losses from a recipe (docs/moe.md): ``model.router_z_loss_coef`` and
its one spelling per computation, the refusals naming the file and the field, one update of a
Mixtral base whose ``config.json`` asks for the load-balancing loss (its event fields against
a NumPy recount), their MLflow points and the report's expert-load panel."""

from __future__ import annotations

import json

import numpy as np
import pytest
from test_mixtral import MIXTRAL, mixtral_tensors, write_checkpoint
from test_moe_router_training import load_recount, z_loss_reference
from test_router_loss import reference as transformers_aux_loss

import minifield
from minifield.hf import pinned_base

AUX_COEF, Z_COEF = 0.05, 0.1


@pytest.fixture
def moe_root(tmp_path):
    """test_base_model's inputs with a Mixtral base that asks for the load-balancing loss."""
    from test_base_model import make_inputs

    root = tmp_path / "in"
    make_inputs(root)
    hf = {
        **MIXTRAL,
        "vocab_size": 340,
        "max_position_embeddings": 128,
        "output_router_logits": True,
        "router_aux_loss_coef": AUX_COEF,
    }
    write_checkpoint(root / "base", hf, mixtral_tensors(hf, seed=5))
    return root


def test_the_z_loss_key_is_one_computation_at_zero_and_refused_where_it_does_not_apply(moe_root):
    from grpo_cases import make_inputs as grpo_inputs
    from grpo_cases import recipe as grpo_recipe
    from test_base_model import base_recipe

    plain = minifield.validate(base_recipe(moe_root))
    assert plain.valid, plain.errors
    zero = minifield.validate(base_recipe(moe_root, {"router_z_loss_coef": 0}))
    assert zero.computation_digest == plain.computation_digest
    other = minifield.validate(base_recipe(moe_root, {"router_z_loss_coef": Z_COEF}))
    assert other.valid and other.computation_digest != plain.computation_digest
    no_base = base_recipe(moe_root, {"router_z_loss_coef": Z_COEF})
    no_base["model"] = {"architecture": "llama", "router_z_loss_coef": Z_COEF}
    errors = {e["path"]: e["message"] for e in minifield.validate(no_base).errors}
    assert errors["/model/router_z_loss_coef"] == "only with model.base (a pinned base model)"
    root = grpo_inputs(moe_root.parent / "grpo")
    raw = grpo_recipe(root)
    raw["model"]["router_z_loss_coef"] = Z_COEF
    errors = {e["path"]: e["message"] for e in minifield.validate(raw).errors}
    assert errors["/model/router_z_loss_coef"].startswith("grpo does not add the router's")


def test_prepare_refuses_what_the_base_cannot_train_naming_config_json(moe_root):
    from test_base_model import _prepare, base_recipe

    from minifield.inputs import pinned

    recipe = base_recipe(moe_root, {"compute_dtype": "float32"})
    loaded = minifield.validate(recipe)
    files = pinned.files_by_name(recipe, moe_root)
    # a strategy whose loss has no router terms (preference, grpo) refuses the base
    with pytest.raises(
        pinned_base.BaseModelError,
        match=r"base/config.json: output_router_logits true asks for the router's "
        r"load-balancing loss, which grpo does not add",
    ):
        pinned_base.load(recipe, files, without_router_loss="grpo")
    assert loaded.valid
    # the z-loss on a base without experts
    dense = json.loads((moe_root / "base" / "config.json").read_text())
    dense.update(model_type="mistral", architectures=["MistralForCausalLM"])
    tensors = {
        k: v for k, v in mixtral_tensors({**MIXTRAL, "vocab_size": 340}, seed=5).items()
        if "block_sparse_moe" not in k
    }  # fmt: skip
    rng = np.random.default_rng(0)
    for i in range(MIXTRAL["num_hidden_layers"]):
        for name, shape in (("gate", (24, 32)), ("up", (24, 32)), ("down", (32, 24))):
            key = f"model.layers.{i}.mlp.{name}_proj.weight"
            tensors[key] = rng.standard_normal(shape).astype(np.float32) * 0.1
    write_checkpoint(moe_root / "base", dense, tensors)
    recipe = base_recipe(moe_root, {"compute_dtype": "float32", "router_z_loss_coef": Z_COEF})
    with pytest.raises(
        pinned_base.BaseModelError,
        match=r"base/config.json: the model has no experts, so model.router_z_loss_coef",
    ):
        _prepare(recipe, moe_root)


@pytest.mark.slow  # prepare, compile and one update of the program (~15 CPU-s)
def test_an_update_reports_the_router_losses_and_the_expert_load(moe_root, tmp_path):
    import jax.numpy as jnp
    from conftest import write_recipe
    from test_base_model import base_recipe

    from minifield import recipe as recipes
    from minifield.inputs import examples
    from minifield.models import llama
    from minifield.observe.report import experts
    from minifield.pipeline import preparation
    from minifield.tracking.attempt_events import metric_points

    model = {"compute_dtype": "float32", "router_z_loss_coef": Z_COEF}
    path = write_recipe(tmp_path / "recipe.json", base_recipe(moe_root, model))
    preparation.prepare(path, moe_root, tmp_path / "examples")
    loaded = recipes.load(path)
    arrays, _ = examples.load(tmp_path / "examples", loaded.examples_digest)
    program = loaded.strategy.build(loaded.data, arrays)
    cfg = program.cfg
    assert (cfg.router_aux_coef, cfg.router_z_coef) == (AUX_COEF, Z_COEF)
    state = program.init_state()
    batch = program.batches.batch(0)
    _, gates = llama.hidden(
        state["params"], cfg, *map(jnp.asarray, (batch.tokens, batch.segments, batch.positions)),
        router=True,
    )  # fmt: skip
    gates, mask = np.asarray(gates), np.asarray(batch.segments) != 0
    assert 0 < mask.sum() < mask.size  # some padding to leave out
    state, metrics = program.step(state)
    E, k = cfg.n_experts, cfg.experts_per_token
    aux = transformers_aux_loss(list(gates), E, k, mask.astype(np.float64))
    z = z_loss_reference(gates, mask)
    np.testing.assert_allclose(metrics["router_aux_loss"], aux, rtol=1e-5)
    np.testing.assert_allclose(metrics["router_z_loss"], z, rtol=1e-5)
    np.testing.assert_allclose(metrics["router_loss"], AUX_COEF * aux + Z_COEF * z, rtol=1e-5)
    assert isinstance(metrics["expert_load"], list) and len(metrics["expert_load"]) == E
    np.testing.assert_allclose(metrics["expert_load"], load_recount(gates, mask, k), atol=1e-6)
    # the export: the base's config.json written back as it was, and it reads back
    program.export(state, tmp_path / "export")
    written = json.loads((tmp_path / "export" / "config.json").read_text())
    assert (written["output_router_logits"], written["router_aux_loss_coef"]) == (True, AUX_COEF)
    assert minifield.load_model(tmp_path / "export").cfg.n_experts == E
    # the event as the loop writes it: one MLflow point per expert beside the scalars
    event = {"type": "update", "seq": 5, "time": 1.0, "step": 1, **metrics}
    points = {p.key: p.value for p in metric_points(event)}
    assert [points[f"expert_load/{e:02d}"] for e in range(E)] == metrics["expert_load"]
    assert points["router_aux_loss"] == metrics["router_aux_loss"]
    # the report: a panel beside the loss curves
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, _ = plt.subplots()
    loads = experts.expert_loads([event, {"type": "update", "loss": 1.0}])
    assert loads == [metrics["expert_load"]]
    experts.draw(fig, loads)
    panel = fig.axes[-1]
    assert len(fig.axes) == 2 and panel.get_xlabel() == "expert"
    assert [round(b.get_height(), 6) for b in panel.patches] == [
        round(s, 6) for s in metrics["expert_load"]
    ]
    plt.close(fig)
