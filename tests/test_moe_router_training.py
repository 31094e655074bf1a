"""The router's training losses of a mixture of experts (docs/moe.md): the load-balancing loss
added as transformers adds it with ``output_router_logits``, the ST-MoE z-loss, the experts'
load reported per update.

References, sharing no code with the project: the router logits of a float64 NumPy forward
from transformers' Mixtral equations (``test_mixtral.reference_logits``), transformers'
``load_balancing_loss_func`` transcribed line by line (``test_router_loss.reference``), the
z-loss and the load recount written here from their definitions. The tiny Mixtral checkpoint
is ``test_mixtral``'s.
"""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from test_mixtral import MIXTRAL, ROWS, mixtral_tensors, reference_logits, write_checkpoint
from test_router_loss import reference as transformers_aux_loss

from minifield.data.packing import Rows
from minifield.hf import checkpoint as hf_checkpoint
from minifield.hf import config as hf_config
from minifield.models import llama, model
from minifield.models.execution import Execution
from minifield.training import train_step

AUX_COEF, Z_COEF = 0.02, 0.1
#: the second row's last four slots are padding
LENGTHS = (12, 8)


def z_loss_reference(gate_logits: np.ndarray, mask: np.ndarray) -> float:
    """ST-MoE eq. 5 over the unmasked (layer, token) pairs, float64: mean of logsumexp^2."""
    g = gate_logits.astype(np.float64)
    top = g.max(-1)
    log_z = top + np.log(np.exp(g - top[..., None]).sum(-1))
    m = np.broadcast_to(mask.reshape(-1), log_z.shape)
    return float((log_z**2 * m).sum() / m.sum())


def load_recount(gate_logits: np.ndarray, mask: np.ndarray, k: int) -> np.ndarray:
    """Per expert, the share of the unmasked (layer, token, choice) triples choosing it."""
    E = gate_logits.shape[-1]
    counts = np.zeros(E)
    for layer in gate_logits:
        for token, logits in enumerate(layer):
            if mask.reshape(-1)[token]:
                for expert in np.argsort(-logits, kind="stable")[:k]:
                    counts[expert] += 1
    return counts / counts.sum()


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    hf = {**MIXTRAL, "output_router_logits": True, "router_aux_loss_coef": AUX_COEF}
    tensors = mixtral_tensors(hf, seed=3)
    directory = write_checkpoint(tmp_path_factory.mktemp("mixtral") / "base", hf, tensors)
    cfg, params = hf_checkpoint.load(directory, max_len=32, compute_dtype="float32")
    cfg = dataclasses.replace(cfg, router_z_coef=Z_COEF)
    mask = np.arange(12)[None, :] < np.asarray(LENGTHS)[:, None]
    batch = Rows(
        tokens=jnp.asarray(ROWS, jnp.int32),
        segments=jnp.asarray(mask, jnp.int32),
        positions=jnp.broadcast_to(jnp.arange(12, dtype=jnp.int32), (2, 12)),
        loss_mask=jnp.asarray(mask, jnp.int32),
    )
    # the reference's router logits per layer [B*T, E]: each row's own tokens alone (packing
    # and padding leave a token's result unchanged); the padded slots get arbitrary values,
    # which the mask must leave out
    rows = []
    for row, length in zip(ROWS, LENGTHS, strict=True):
        gates: list[np.ndarray] = []
        reference_logits(tensors, hf, row[:length], gate_logits=gates)
        rows.append([np.pad(g, ((0, 12 - length), (0, 0)), constant_values=7.0) for g in gates])
    gate_LxNxE = np.stack([np.concatenate([r[i] for r in rows]) for i in range(2)])
    return {"cfg": cfg, "params": params, "batch": batch, "mask": mask, "gates": gate_LxNxE}


#: the loss and its metrics, compiled once per config and batch shape (run op by op, every
#: primitive and every grouped product's loop would be compiled on its own)
_jit_loss = jax.jit(model.loss_fn, static_argnums=1)


def _step_metrics(cfg, params, batch, accum_steps=1):
    state = {
        "params": params,
        "opt_state": optax.sgd(0.0).init(params),
        "rng": jnp.zeros((2,), jnp.uint32),
        "step": jnp.zeros((), jnp.int32),
        "cursor": jnp.zeros((), jnp.int32),
    }
    step = train_step.make_train_step(cfg, optax.sgd(0.0), accum_steps=accum_steps)
    return jax.jit(step)(state, batch)[1]


def test_config_json_asks_for_the_loss_and_export_writes_it_back(case, tmp_path):
    assert case["cfg"].router_aux_coef == AUX_COEF
    assert hf_config.config_from_hf(MIXTRAL, max_len=32).router_aux_coef is None
    olmoe = {"model_type": "olmoe", "architectures": None, "output_router_logits": True}
    bare = {k: v for k, v in MIXTRAL.items() if k != "router_aux_loss_coef"}
    assert hf_config.config_from_hf({**bare, **olmoe}, max_len=32).router_aux_coef == 0.01
    # what the model is trained with is not in its description (an export's model.json)
    assert "router_aux_coef" not in case["cfg"].to_dict()
    assert "router_z_coef" not in case["cfg"].to_dict()
    hf_checkpoint.write(tmp_path / "out", case["cfg"], case["params"])  # no base config.json
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    assert (written["output_router_logits"], written["router_aux_loss_coef"]) == (True, AUX_COEF)


@pytest.fixture(scope="module")
def loop_metrics(case):
    """One update's metrics, the layers in a loop (compiled once for the tests below)."""
    return _step_metrics(case["cfg"], case["params"], case["batch"])


@pytest.mark.slow  # its update's compile (3.5 s); the fast tier keeps the config's round trip
def test_the_training_step_reports_transformers_losses_and_the_load_with_padding(
    case, loop_metrics
):
    cfg, gates, mask, metrics = case["cfg"], case["gates"], case["mask"], loop_metrics
    E, k = cfg.n_experts, cfg.experts_per_token
    aux = transformers_aux_loss(list(gates), E, k, mask.astype(np.float64))
    z = z_loss_reference(gates, mask)
    np.testing.assert_allclose(float(metrics["router_aux_loss"]), aux, rtol=1e-5)
    np.testing.assert_allclose(float(metrics["router_z_loss"]), z, rtol=1e-5)
    np.testing.assert_allclose(
        np.asarray(metrics["expert_load"]), load_recount(gates, mask, k), atol=1e-7
    )
    lm = float(metrics["loss_sum"]) / float(metrics["tokens"])
    np.testing.assert_allclose(float(metrics["loss"]), lm + AUX_COEF * aux + Z_COEF * z, rtol=1e-6)
    # the padded slots count: without the mask the reference differs
    assert abs(transformers_aux_loss(list(gates), E, k) - aux) > 1e-3


@pytest.mark.slow  # compile-heavy for the fast tier (one more update or gradient)
def test_a_scanned_stack_with_remat_gives_the_same_router_terms_and_gradient(case, loop_metrics):
    cfg, params, batch = case["cfg"], case["params"], case["batch"]
    scanned = dataclasses.replace(cfg, execution=Execution(scan_layers=True, remat="full"))
    other = _step_metrics(scanned, params, batch)
    for name in ("loss", "grad_norm", "router_aux_loss", "router_z_loss", "expert_load"):
        np.testing.assert_allclose(
            np.asarray(other[name]), np.asarray(loop_metrics[name]), rtol=1e-5
        )


@pytest.mark.slow  # compile-heavy for the fast tier (one more update or gradient)
def test_the_gradient_of_the_router_terms_reaches_the_router(case):
    """grad(loss with the terms) - grad(loss without) along a direction of layer 0's router
    equals the terms' central finite difference along it."""
    cfg, params, batch = case["cfg"], case["params"], case["batch"]
    direction = np.random.default_rng(0).standard_normal(
        params["blocks"]["00"]["moe"]["router"].shape
    )
    direction = jnp.asarray(direction / np.linalg.norm(direction), jnp.float32)
    off = dataclasses.replace(cfg, router_aux_coef=None, router_z_coef=0.0)

    def loss_difference(p):  # one program: both losses share their forward (CSE)
        return model.loss_fn(p, cfg, batch)[0] - model.loss_fn(p, off, batch)[0]

    def grad_along():
        g = jax.jit(jax.grad(loss_difference))(params)
        return float(jnp.sum(g["blocks"]["00"]["moe"]["router"] * direction))

    terms = jax.jit(lambda p: model.loss_fn(p, cfg, batch)[1]["router_loss"])

    def terms_at(eps):
        moved = jax.tree_util.tree_map(lambda x: x, params)
        moved["blocks"]["00"]["moe"]["router"] = params["blocks"]["00"]["moe"]["router"] + (
            eps * direction
        )
        return float(terms(moved))

    eps = 1e-2
    finite = (terms_at(eps) - terms_at(-eps)) / (2 * eps)
    analytic = grad_along()  # grad(loss with the terms - loss without)
    assert abs(finite) > 1e-3  # the terms move with the router
    np.testing.assert_allclose(analytic, finite, rtol=2e-2)


@pytest.mark.slow  # compile-heavy for the fast tier (one more update or gradient)
def test_micro_batches_weigh_each_forward_by_its_trained_tokens(case):
    """With two micro-batches (rows 0 and 1), the update minimises
    sum_i tokens_i (lm_i + router_i) / tokens; the reported router losses are those means."""
    cfg, params, batch = case["cfg"], case["params"], case["batch"]
    metrics = _step_metrics(cfg, params, batch, accum_steps=2)
    parts = []
    for row in range(2):
        micro = Rows._make(value[row : row + 1] for value in batch)
        parts.append(_jit_loss(params, cfg, micro)[1])  # both rows: one compiled program
    tokens = np.asarray([float(p["tokens"]) for p in parts])
    for name in ("router_aux_loss", "router_z_loss"):
        expected = float(np.dot(tokens, [float(p[name]) for p in parts]) / tokens.sum())
        np.testing.assert_allclose(float(metrics[name]), expected, rtol=1e-5)
    whole = sum(
        float(p["loss_sum"]) + t * float(p["router_loss"])
        for p, t in zip(parts, tokens, strict=True)
    )
    np.testing.assert_allclose(float(metrics["loss"]), whole / tokens.sum(), rtol=1e-5)
    np.testing.assert_allclose(
        np.asarray(metrics["expert_load"]),
        load_recount(case["gates"], case["mask"], cfg.experts_per_token),
        atol=1e-7,
    )


@pytest.mark.slow  # compile-heavy for the fast tier (one more update or gradient)
def test_without_the_router_terms_the_loss_is_the_language_models_alone(case):
    """output_router_logits false (the default) and no z-loss: nothing changes."""
    cfg = dataclasses.replace(case["cfg"], router_aux_coef=None, router_z_coef=0.0)
    metrics = _step_metrics(cfg, case["params"], case["batch"])
    assert sorted(metrics) == ["grad_norm", "loss", "loss_sum", "tokens"]
    assert metrics["loss"] == metrics["loss_sum"] / metrics["tokens"]
    hidden = jax.jit(llama.hidden, static_argnums=1, static_argnames="router")
    h, logits = hidden(
        case["params"], case["cfg"], *case["batch"][:3],  # tokens, segments, positions
        router=True,
    )  # fmt: skip
    assert logits.shape == (2, 24, cfg.n_experts)
    np.testing.assert_allclose(
        np.asarray(logits)[:, case["mask"].reshape(-1)],
        case["gates"][:, case["mask"].reshape(-1)],
        atol=1e-4,
    )


@pytest.mark.slow  # the Qwen2-MoE model traced only, yet out of the fast tier
def test_only_the_sparse_layers_of_a_qwen2_moe_give_router_logits():
    from test_moe_families import QWEN2_MOE

    cfg = hf_config.config_from_hf(QWEN2_MOE, max_len=32)  # layer 1 dense
    sparse = [i for i in range(cfg.n_layers) if cfg.is_moe_layer(i)]
    assert 0 < len(sparse) < cfg.n_layers
    tokens = jnp.asarray([ROWS[0]], jnp.int32)
    positions = jnp.arange(12, dtype=jnp.int32)[None]
    segments = jnp.ones_like(tokens)

    def router_logits():
        params = model.init_params(cfg, jax.random.key(0))
        return llama.hidden(params, cfg, tokens, segments, positions, router=True)[1]

    # what is asserted is the shape and dtype the model traces to: traced, not compiled (the
    # Qwen2-MoE forward's values are test_moe_families' logits tests)
    logits = jax.eval_shape(router_logits)
    assert logits.shape == (len(sparse), 12, cfg.n_experts) and logits.dtype == jnp.float32
