"""The experts held stacked (``moe/experts/w_gate`` ``[E, in, out]``) compute what the experts
held one matrix per expert computed, and export the same files.

The previous layout's computation is rebuilt here as it was: one ``[in, out]`` matrix per expert
(``moe/experts/JJ/w_gate``), stacked inside the traced function before the layer runs. Its loss
and its per-expert gradients must be the stacked state's, bit for bit. The export reference is
written here with ``safetensors.numpy`` from the per-expert tensors under names spelled out by
hand (transformers' Mixtral and Qwen2-MoE names), not through the project's writer.
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import load_file, save

from minifield.hf import checkpoint as hf_checkpoint
from minifield.hf import stored_base
from minifield.models import expert_slots, families, llama, model

LEAVES = ("w_gate", "w_up", "w_down")


def config(**overrides):
    fields = dict(
        vocab_size=40, d_model=16, n_layers=2, n_heads=2, n_kv_heads=1, d_ff=24, max_len=16,
        compute_dtype="bfloat16", n_experts=4, experts_per_token=2,
    )  # fmt: skip
    return llama.LlamaConfig(**{**fields, **overrides})


def _each_moe_experts(params, change):
    """``params`` with every MoE layer's ``experts`` dict replaced by ``change(experts)``."""

    def convert(node):
        if not isinstance(node, dict):
            return node
        out = {k: convert(v) for k, v in node.items()}
        if "experts" in node and "router" in node:
            out["experts"] = change(node["experts"])
        return out

    return convert(params)


def per_expert(params):
    """The previous layout: each ``moe/experts`` dict ``{JJ: {w_gate, w_up, w_down}}``."""

    def split(stacked):
        count = stacked["w_gate"].shape[0]
        return {f"{j:02d}": {k: stacked[k][j] for k in LEAVES} for j in range(count)}

    return _each_moe_experts(params, split)


def stacked_in_trace(params):
    """What the previous ``moe.py`` did inside the step: every expert's matrix stacked."""

    def stack(experts):
        names = sorted(experts, key=int)
        return {k: jnp.stack([experts[j][k] for j in names]) for k in LEAVES}

    return _each_moe_experts(params, stack)


@pytest.mark.slow  # two compiled forward-and-backward passes
# with a shared expert beside the stacked ones (Qwen2-MoE's), which covers the case without
@pytest.mark.parametrize("shared", [12])
def test_loss_and_gradients_equal_the_per_expert_layouts_to_the_bit(shared):
    cfg = config(shared_expert_d_ff=shared)
    params = llama.init_params(cfg, jax.random.key(3))
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (2, 12)), jnp.int32)
    segments = jnp.asarray([[1] * 7 + [2] * 5, [1] * 10 + [0] * 2], jnp.int32)
    positions = jnp.asarray([list(range(7)) + list(range(5)), list(range(12))], jnp.int32)

    def loss(p):
        logits = model.forward(p, cfg, tokens, segments, positions)
        return jnp.mean(jax.nn.log_softmax(logits)[..., 1])

    new_loss, new_grads = jax.jit(jax.value_and_grad(loss))(params)
    old = per_expert(params)
    old_loss, old_grads = jax.jit(jax.value_and_grad(lambda p: loss(stacked_in_trace(p))))(old)
    assert np.asarray(new_loss).tobytes() == np.asarray(old_loss).tobytes()
    new_flat = dict(stored_base.flatten(per_expert(jax.tree_util.tree_map(np.asarray, new_grads))))
    old_flat = dict(stored_base.flatten(jax.tree_util.tree_map(np.asarray, old_grads)))
    assert new_flat.keys() == old_flat.keys()
    assert any("/moe/experts/03/w_down" in path for path in new_flat)
    for path, value in old_flat.items():
        assert new_flat[path].tobytes() == value.tobytes(), path
    assert np.abs(new_flat["blocks/01/moe/experts/00/w_up"]).max() > 0


def hand_named(cfg, old) -> dict:
    """HF name -> ``[out, in]`` FP32 tensor of the per-expert layout, names spelled by hand."""
    mixtral = not cfg.shared_expert_d_ff
    moe_part = "block_sparse_moe" if mixtral else "mlp"
    proj = dict(
        zip(
            LEAVES,
            ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj"),
            strict=True,
        )
    )
    out = {
        "model.embed_tokens.weight": old["embed"]["tokens"],
        "model.norm.weight": old["final_norm"]["scale"],
    }
    out["lm_head.weight"] = old["head"]["w"].T
    for i in range(cfg.n_layers):
        b, pre = old["blocks"][f"{i:02d}"], f"model.layers.{i}."
        out[pre + "input_layernorm.weight"] = b["attn_norm"]["scale"]
        out[pre + "post_attention_layernorm.weight"] = b["mlp_norm"]["scale"]
        for w, name in zip(("wq", "wk", "wv", "wo"), ("q", "k", "v", "o"), strict=True):
            out[pre + f"self_attn.{name}_proj.weight"] = b["attn"][w].T
        for bias, name in zip(("bq", "bk", "bv"), "qkv", strict=True):
            if bias in b["attn"]:
                out[pre + f"self_attn.{name}_proj.bias"] = b["attn"][bias]
        out[pre + f"{moe_part}.gate.weight"] = b["moe"]["router"].T
        for j, expert in b["moe"]["experts"].items():
            for leaf in LEAVES:
                out[pre + f"{moe_part}.experts.{int(j)}.{proj[leaf]}.weight"] = expert[leaf].T
        if "shared" in b["moe"]:
            for leaf in LEAVES:
                out[pre + f"mlp.shared_expert.{proj[leaf]}.weight"] = b["moe"]["shared"][leaf].T
            out[pre + "mlp.shared_expert_gate.weight"] = b["moe"]["shared_gate"].T
    return {k: np.ascontiguousarray(np.asarray(v, np.float32)) for k, v in out.items()}  # fmt: skip


@pytest.mark.parametrize("shared", [0, 12])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_export_is_the_per_expert_layouts_file_and_loads_back_stacked(tmp_path, shared, dtype):
    names = "mlp" if shared else "mixtral"  # Qwen2-MoE's names with its shared expert
    cfg = config(
        shared_expert_d_ff=shared, qkv_bias=bool(shared), tie_embeddings=False, moe_names=names
    )
    rng = np.random.default_rng(1)
    params = jax.tree_util.tree_map(
        lambda a: rng.standard_normal(a.shape).astype(np.float32),
        jax.eval_shape(lambda: llama.init_params(cfg, jax.random.key(0))),
    )
    hf_checkpoint.write(tmp_path / "one", cfg, params, dtype=dtype)
    stored = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16}[dtype]
    expected = {k: v.astype(stored) for k, v in hand_named(cfg, per_expert(params)).items()}
    written = (tmp_path / "one" / "model.safetensors").read_bytes()
    assert written == save(expected, metadata={"format": "pt"})
    # sharded: the same tensors, each byte for byte, wherever the plan put it
    hf_checkpoint.write(tmp_path / "shards", cfg, params, dtype=dtype, max_shard_size=4000)
    index = json.loads((tmp_path / "shards" / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(expected)
    for file in set(index["weight_map"].values()):
        for name, value in load_file(str(tmp_path / "shards" / file)).items():
            assert value.tobytes() == expected[name].tobytes(), name
    # loaded back: each expert's tensor is the j-th of the stacked parameter
    _, loaded = hf_checkpoint.load(tmp_path / "one")
    experts = loaded["blocks"]["01"]["moe"]["experts"]
    assert experts["w_down"].shape == (4, 24, 16)
    for j in range(cfg.n_experts):
        name = f"model.layers.1.{'mlp' if shared else 'block_sparse_moe'}.experts.{j}."
        name += "down_proj.weight" if shared else "w2.weight"
        want = expected[name].astype(np.float32).T
        np.testing.assert_array_equal(np.asarray(experts["w_down"][j]), want)


def test_a_stored_base_widens_stacked_experts_slice_by_slice():
    rng = np.random.default_rng(2)
    data = rng.standard_normal((4, 6, 5)).astype(ml_dtypes.bfloat16)  # [E, out, in] as stored
    slices = stored_base.FP32Slices(data, True)
    whole = np.asarray(slices)
    assert slices.shape == whole.shape == (4, 5, 6)
    np.testing.assert_array_equal(whole[1], data[1].astype(np.float32).T)
    for index in [
        (slice(None), slice(0, 3)),
        (slice(1, 3),),
        (slice(None), slice(None), slice(2, 6)),
    ]:
        np.testing.assert_array_equal(slices[index], whole[index])  # fmt: skip


def test_prepared_per_expert_arrays_are_stacked_when_read():
    """Examples prepared when the experts were held one by one still give the stacked base."""
    rng = np.random.default_rng(3)
    per = {j: rng.standard_normal((6, 5)).astype(np.float32) for j in range(3)}
    arrays = {
        f"base.blocks.00.moe.experts.{j:02d}.w_up": v.view(np.float32) for j, v in per.items()
    }
    layout = {
        f"blocks/00/moe/experts/{j:02d}/w_up": {"dtype": "float32", "out_in": True} for j in per
    }
    arrays[stored_base.LAYOUT_ARRAY] = np.frombuffer(json.dumps(layout).encode(), np.uint8)
    (path, value, out_in), *rest = list(stored_base.stored(arrays))
    assert not rest and path == "blocks/00/moe/experts/w_up" and out_in
    np.testing.assert_array_equal(value, np.stack([per[j] for j in range(3)]))


def test_expert_slots_name_the_stacked_parameter():
    cfg = config()
    assert expert_slots.expert_slot("blocks/01/moe/experts/03/w_down") == (
        "blocks/01/moe/experts/w_down",
        3,
    )
    assert expert_slots.expert_slot("blocks/01/moe/shared/w_down") is None
    assert families.param_shape(cfg, "blocks/01/moe/experts/w_down") == (4, 24, 16)
    assert families.param_shape(cfg, "blocks/01/moe/experts/03/w_down") == (24, 16)  # fmt: skip
