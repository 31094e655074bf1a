"""Mixtral (a mixture of experts) in, computed, generated, trained one update, out.

A tiny Mixtral checkpoint is written here by hand: random tensors under the names
transformers' ``modeling_mixtral.py`` gives them (``block_sparse_moe.gate``,
``block_sparse_moe.experts.{j}.w1/w2/w3``), saved with ``safetensors.numpy`` (no torch), and
a hand-written ``config.json``. The reference is a float64 NumPy forward written in this file
from transformers' PyTorch equations (``MixtralSparseMoeBlock``: softmax over every expert's
router logit, top-k, divided by the top-k's sum; ``MixtralBlockSparseTop2MLP``:
``w2(silu(w1(x)) * w3(x))``; Mistral's attention with its sliding window), sharing no code
with the project's model.
"""

from __future__ import annotations

import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from minifield.hf import checkpoint as hf_checkpoint
from minifield.hf import config as hf_config
from minifield.models import model, moe
from minifield.models.execution import Execution

MIXTRAL = {
    "architectures": ["MixtralForCausalLM"],
    "model_type": "mixtral",
    "vocab_size": 61,
    "hidden_size": 32,
    "intermediate_size": 24,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
    "rms_norm_eps": 1e-5,
    "rope_theta": 1000000.0,
    "tie_word_embeddings": False,
    "hidden_act": "silu",
    "sliding_window": 6,  # binds on these 12-token rows
    "num_local_experts": 4,
    "num_experts_per_tok": 2,
    "output_router_logits": False,
    "router_aux_loss_coef": 0.02,
    "router_jitter_noise": 0.0,
    "attention_dropout": 0.0,
}
ROWS = [[1, 5, 7, 9, 11, 13, 2, 60, 3, 3, 40, 17], [56, 0, 4, 8, 15, 16, 23, 42, 8, 1, 9, 30]]


def mixtral_tensors(hf: dict, seed: int) -> dict[str, np.ndarray]:
    """Random FP32 tensors under transformers' Mixtral names, ``[out, in]`` layouts."""
    rng = np.random.default_rng(seed)
    D, F, V = hf["hidden_size"], hf["intermediate_size"], hf["vocab_size"]
    H, G = hf["num_attention_heads"], hf["num_key_value_heads"]
    K, E = D // H, hf["num_local_experts"]

    def w(*shape, scale=None):
        scale = shape[-1] ** -0.5 if scale is None else scale
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    t = {"model.embed_tokens.weight": w(V, D, scale=0.5), "model.norm.weight": 1 + w(D, scale=0.1)}
    for i in range(hf["num_hidden_layers"]):
        p = f"model.layers.{i}."
        t[p + "input_layernorm.weight"] = 1 + w(D, scale=0.1)
        t[p + "post_attention_layernorm.weight"] = 1 + w(D, scale=0.1)
        t[p + "self_attn.q_proj.weight"] = w(H * K, D)
        t[p + "self_attn.k_proj.weight"] = w(G * K, D)
        t[p + "self_attn.v_proj.weight"] = w(G * K, D)
        t[p + "self_attn.o_proj.weight"] = w(D, H * K)
        t[p + "block_sparse_moe.gate.weight"] = w(E, D, scale=0.5)
        for j in range(E):
            e = p + f"block_sparse_moe.experts.{j}."
            t[e + "w1.weight"] = w(F, D)
            t[e + "w3.weight"] = w(F, D)
            t[e + "w2.weight"] = w(D, F)
    t["lm_head.weight"] = w(V, D)
    return t


def write_checkpoint(directory, hf: dict, tensors: dict):
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    (directory / "config.json").write_text(json.dumps(hf))
    return directory


def reference_logits(t: dict, hf: dict, ids, routing=None, gate_logits=None) -> np.ndarray:
    """One unpacked row, float64, from modeling_mixtral's equations; ``routing`` (a list)
    collects each layer's top-k margin (how far the k-th router logit is from the next),
    ``gate_logits`` (a list) each layer's router logits ``[T, E]``."""
    t = {k: v.astype(np.float64) for k, v in t.items()}
    H, G = hf["num_attention_heads"], hf["num_key_value_heads"]
    D, k = hf["hidden_size"], hf["num_experts_per_tok"]
    K, eps, T = D // H, hf["rms_norm_eps"], len(ids)

    def rms(x, weight):
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * weight

    inv_freq = 1.0 / hf["rope_theta"] ** (np.arange(0, K, 2) / K)
    angle = np.arange(T)[:, None] * inv_freq[None, :]
    cos, sin = np.cos(np.concatenate([angle] * 2, -1)), np.sin(np.concatenate([angle] * 2, -1))

    def rope(x):  # rotate_half(x) = [-x2, x1]
        rotated = np.concatenate([-x[..., K // 2 :], x[..., : K // 2]], axis=-1)
        return x * cos[:, None, :] + rotated * sin[:, None, :]

    def silu(x):
        return x / (1 + np.exp(-x))

    q_idx, kv_idx = np.arange(T)[:, None], np.arange(T)[None, :]
    allowed = (kv_idx <= q_idx) & (kv_idx > q_idx - hf["sliding_window"])
    x = t["model.embed_tokens.weight"][np.asarray(ids)]
    for i in range(hf["num_hidden_layers"]):
        p = f"model.layers.{i}."
        h = rms(x, t[p + "input_layernorm.weight"])
        q, kk, v = (h @ t[p + f"self_attn.{n}_proj.weight"].T for n in "qkv")
        q, kk, v = q.reshape(T, H, K), kk.reshape(T, G, K), v.reshape(T, G, K)
        q, kk = rope(q), rope(kk)
        kk, v = kk[:, np.arange(H) // (H // G)], v[:, np.arange(H) // (H // G)]
        scores = np.einsum("thk,shk->hts", q, kk) / np.sqrt(K)
        scores = np.where(allowed, scores, -np.inf)
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        out = np.einsum("hts,shk->thk", probs, v).reshape(T, H * K)
        x = x + out @ t[p + "self_attn.o_proj.weight"].T
        h = rms(x, t[p + "post_attention_layernorm.weight"])
        # MixtralSparseMoeBlock: softmax over all experts, topk, /= sum of the top-k
        logits = h @ t[p + "block_sparse_moe.gate.weight"].T
        router = np.exp(logits - logits.max(-1, keepdims=True))
        router /= router.sum(-1, keepdims=True)
        ranked = np.argsort(-router, axis=-1, kind="stable")
        if gate_logits is not None:
            gate_logits.append(logits)
        if routing is not None:
            ranked_logits = np.take_along_axis(logits, ranked, -1)
            routing.append(float((ranked_logits[:, k - 1] - ranked_logits[:, k]).min()))
        moe = np.zeros_like(h)
        for token in range(T):
            chosen = ranked[token, :k]
            weights = router[token, chosen] / router[token, chosen].sum()
            for j, weight in zip(chosen, weights, strict=True):
                e = p + f"block_sparse_moe.experts.{j}."
                a = silu(h[token] @ t[e + "w1.weight"].T) * (h[token] @ t[e + "w3.weight"].T)
                moe[token] += weight * (a @ t[e + "w2.weight"].T)
        x = x + moe
    return rms(x, t["model.norm.weight"]) @ t["lm_head.weight"].T


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    tensors = mixtral_tensors(MIXTRAL, seed=3)
    directory = write_checkpoint(tmp_path_factory.mktemp("mixtral") / "base", MIXTRAL, tensors)
    cfg, params = hf_checkpoint.load(directory, max_len=32, compute_dtype="float32")
    return {"tensors": tensors, "dir": directory, "cfg": cfg, "params": params}


# one compiled program per config and row length; run op by op, the forward compiled each
# primitive, and each layer's scan afresh, in every test
forward = jax.jit(model.forward, static_argnums=1)


def packed_logits(cfg, params, tokens, segments, positions) -> np.ndarray:
    arrays = (jnp.asarray([x], jnp.int32) for x in (tokens, segments, positions))
    return np.asarray(forward(params, cfg, *arrays))[0]


def our_logits(cfg, params, row) -> np.ndarray:
    return packed_logits(cfg, params, row, [1] * len(row), list(range(len(row))))


# -- config.json -----------------------------------------------------------------------------------


def test_config_json_fields_are_read():
    cfg = hf_config.config_from_hf(MIXTRAL, max_len=32)
    assert (cfg.n_experts, cfg.experts_per_token, cfg.sliding_window) == (4, 2, 6)
    assert (cfg.d_ff, cfg.rope_theta, cfg.qkv_bias, cfg.qk_norm) == (24, 1e6, False, False)
    # transformers' defaults: 8 experts, top 2, rope_theta 1e6; a window null: none
    bare = {
        k: v
        for k, v in MIXTRAL.items()
        if k not in ("num_local_experts", "num_experts_per_tok", "rope_theta")
    }
    bare["sliding_window"] = None
    cfg = hf_config.config_from_hf(bare, max_len=32)
    assert (cfg.n_experts, cfg.experts_per_token, cfg.rope_theta, cfg.sliding_window) == (
        8,
        2,
        1e6,
        None,
    )
    assert model.config_from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg
    dense = hf_config.config_from_hf({**MIXTRAL, "model_type": "mistral", "architectures": None})
    assert "n_experts" not in dense.to_dict()


@pytest.mark.parametrize(
    "change, message",
    [
        ({"router_jitter_noise": 0.01}, r"config.json: router_jitter_noise 0.01 is not supported"),
        ({"num_experts_per_tok": 5}, r"config.json: num_experts_per_tok 5 exceeds num_local"),
        ({"num_local_experts": 0}, r"config.json: num_local_experts must be a positive integer"),
        ({"router_aux_loss_coef": "high"}, r"config.json: router_aux_loss_coef must be a number"),
    ],
)
def test_what_is_not_computed_is_refused_naming_file_and_field(case, tmp_path, change, message):
    directory = tmp_path / "bad"
    shutil.copytree(case["dir"], directory)
    (directory / "config.json").write_text(json.dumps({**MIXTRAL, **change}))
    with pytest.raises(hf_checkpoint.CheckpointError, match=str(directory) + "/" + message):
        hf_checkpoint.load(directory, max_len=32)


def test_a_missing_expert_tensor_is_refused_naming_it(case, tmp_path):
    tensors = dict(case["tensors"])
    del tensors["model.layers.1.block_sparse_moe.experts.3.w2.weight"]
    directory = write_checkpoint(tmp_path / "missing", MIXTRAL, tensors)
    with pytest.raises(hf_checkpoint.CheckpointError, match=r"experts.3.w2.weight missing"):
        hf_checkpoint.load(directory, max_len=32)


# -- the forward -----------------------------------------------------------------------------------


def test_logits_match_the_written_equations(case):
    for row in ROWS:
        margins: list[float] = []
        expected = reference_logits(case["tensors"], MIXTRAL, row, margins)
        assert min(margins) > 1e-3  # no top-k near-tie that FP32 could break the other way
        np.testing.assert_allclose(
            our_logits(case["cfg"], case["params"], row), expected, atol=1e-4
        )


def test_the_routing_changes_the_logits(case):
    """Renormalising, or taking every expert, gives other logits: the test above could not
    pass with either."""
    cfg, params = case["cfg"], case["params"]
    ours = our_logits(cfg, params, ROWS[0])
    every = {**MIXTRAL, "num_experts_per_tok": 4}
    cfg_every = hf_config.config_from_hf(every, max_len=32, compute_dtype="float32")
    assert np.abs(our_logits(cfg_every, params, ROWS[0]) - ours).max() > 1e-2
    np.testing.assert_allclose(
        our_logits(cfg_every, params, ROWS[0]),
        reference_logits(case["tensors"], every, ROWS[0]),
        atol=1e-4,
    )
    # the routing itself: weights sum to one, k distinct experts per token
    # NumPy states and one compiled routing: op by op, every primitive compiled on its own
    x = np.random.default_rng(0).standard_normal((50, 32)).astype(np.float32)
    router = params["blocks"]["00"]["moe"]["router"]
    route = jax.jit(lambda x, router: moe.route_logits(cfg, moe.router_logits(x, router)))
    weights, experts = route(x, router)
    np.testing.assert_allclose(np.asarray(weights).sum(-1), 1.0, rtol=1e-6)
    assert all(len(set(r)) == 2 for r in np.asarray(experts).tolist())


@pytest.mark.slow
def test_each_segment_of_a_packed_row_equals_the_example_alone(case):
    cfg, params = case["cfg"], case["params"]
    a, b, c = ROWS[0][:7], ROWS[1][:9], ROWS[0][3:8]
    tokens = a + b + c + [0, 0]
    segments = [1] * 7 + [2] * 9 + [3] * 5 + [0, 0]
    positions = list(range(7)) + list(range(9)) + list(range(5)) + [0, 1]
    packed = packed_logits(cfg, params, tokens, segments, positions)
    for example, start in ((a, 0), (b, 7), (c, 16)):
        # alone in a row as long as the packed one, padding (segment 0) after it: one
        # compiled forward serves every call
        pad = len(tokens) - len(example)
        alone = packed_logits(
            cfg, params, example + [0] * pad, [1] * len(example) + [0] * pad,
            list(range(len(example))) + [0] * pad,
        )[: len(example)]  # fmt: skip
        np.testing.assert_allclose(packed[start : start + len(example)], alone, atol=1e-5)


def test_a_scanned_stack_and_remat_compute_the_same_logits(case):
    cfg, params = case["cfg"], case["params"]
    scanned = cfg.__class__(**{**cfg.__dict__, "execution": Execution(scan_layers=True)})
    np.testing.assert_allclose(
        our_logits(scanned, params, ROWS[1]), our_logits(cfg, params, ROWS[1]), atol=1e-5
    )


@pytest.mark.slow  # compiles the gradient (~2.5 s under 3.12)
def test_gradients_reach_the_router_and_every_used_expert(case):
    cfg, params = case["cfg"], case["params"]
    tokens = jnp.asarray(ROWS, jnp.int32)
    segments, positions = jnp.ones_like(tokens), jnp.broadcast_to(jnp.arange(12), (2, 12))

    def loss(p):
        logits = model.forward(p, cfg, tokens, segments, positions)
        return jnp.mean(jax.nn.log_softmax(logits)[..., 0])

    grads = jax.jit(jax.grad(loss))(params)
    layer = grads["blocks"]["01"]["moe"]
    assert np.abs(np.asarray(layer["router"])).max() > 0
    used = sum(np.abs(e).max() > 0 for e in np.asarray(layer["experts"]["w_down"]))
    assert used >= 2
    assert all(np.isfinite(np.asarray(g)).all() for g in jax.tree_util.tree_leaves(grads))


@pytest.mark.slow
def test_cached_greedy_generation_equals_uncached_and_the_reference(case):
    cfg, params = case["cfg"], case["params"]
    prompt, expected = ROWS[0][:5], []
    for _ in range(8):
        logits = reference_logits(case["tensors"], MIXTRAL, prompt + expected)
        expected.append(int(np.argmax(logits[-1])))
    cached = model.greedy_generate(params, cfg, prompt, 8, None)
    uncached = model.greedy_generate(params, cfg, prompt, 8, None, cache=False)
    assert cached == uncached == expected


# -- out -------------------------------------------------------------------------------------------


def test_export_then_load_is_byte_equal_and_config_field_by_field(case, tmp_path):
    cfg, params = case["cfg"], case["params"]
    with_base, without = tmp_path / "with-base", tmp_path / "without"
    hf_checkpoint.write(with_base, cfg, params, base_config=MIXTRAL)
    written_config = json.loads((with_base / "config.json").read_text())
    assert written_config == {**MIXTRAL, "torch_dtype": "float32"}
    written = load_file(str(with_base / "model.safetensors"))
    assert sorted(written) == sorted(case["tensors"])
    for key, value in case["tensors"].items():
        assert written[key].dtype == value.dtype and written[key].tobytes() == value.tobytes(), key
    again, params_again = hf_checkpoint.load(with_base, max_len=32, compute_dtype="float32")
    assert again == cfg
    # without a base config.json: a Mixtral config that reads back as the same model
    hf_checkpoint.write(without, cfg, params)
    config = json.loads((without / "config.json").read_text())
    assert (config["model_type"], config["architectures"]) == ("mixtral", ["MixtralForCausalLM"])
    assert (config["num_local_experts"], config["num_experts_per_tok"]) == (4, 2)
    assert (config["router_jitter_noise"], config["output_router_logits"]) == (0.0, False)
    again, params_again = hf_checkpoint.load(without, max_len=32, compute_dtype="float32")
    assert again == cfg
    np.testing.assert_array_equal(
        our_logits(again, params_again, ROWS[1]), our_logits(cfg, params, ROWS[1])
    )


# -- training ----------------------------------------------------------------------------------


@pytest.fixture
def base_root(tmp_path):
    """test_base_model's inputs (chat rows, tokenizer, ChatML template) with a Mixtral base."""
    from test_base_model import make_inputs

    root = tmp_path / "in"
    make_inputs(root)
    hf = {**MIXTRAL, "vocab_size": 340, "max_position_embeddings": 128}
    write_checkpoint(root / "base", hf, mixtral_tensors(hf, seed=5))
    return root


@pytest.mark.slow  # a worker-shaped update of a Mixtral base (3.4 s); the fast tier keeps the gradients' test
def test_a_full_fine_tune_of_a_mixtral_base_runs_an_update(base_root, tmp_path):
    from conftest import write_recipe
    from test_base_model import base_recipe

    from minifield import recipe as recipes
    from minifield.inputs import examples
    from minifield.pipeline import preparation

    recipe = base_recipe(base_root, {"compute_dtype": "float32"})
    path = write_recipe(tmp_path / "recipe.json", recipe)
    preparation.prepare(path, base_root, tmp_path / "examples")
    loaded = recipes.load(path)
    arrays, _ = examples.load(tmp_path / "examples", loaded.examples_digest)
    program = loaded.strategy.build(loaded.data, arrays)
    assert (program.cfg.n_experts, program.cfg.experts_per_token) == (4, 2)
    state = program.init_state()
    on_disk = load_file(str(base_root / "base" / "model.safetensors"))
    expert = state["params"]["blocks"]["01"]["moe"]["experts"]["w_up"][2]
    np.testing.assert_array_equal(
        np.asarray(expert), on_disk["model.layers.1.block_sparse_moe.experts.2.w3.weight"].T
    )
    before = np.asarray(state["params"]["blocks"]["00"]["moe"]["router"]).copy()
    state, metrics = program.step(state)
    assert np.isfinite(metrics["loss"])
    after = np.asarray(state["params"]["blocks"]["00"]["moe"]["router"])
    assert np.abs(after - before).max() > 0
