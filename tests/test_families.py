"""Model families beyond the plain Llama block, against the float64 reference of
:mod:`family_reference` (written from transformers' PyTorch models, sharing no code with the
project): Mistral's and Phi-3's sliding window, Qwen2's per-layer windows, Qwen3's q/k norms
and explicit ``head_dim``, Phi-3's fused projections and longrope, Gemma's (1+w) norms, scaled
embeddings and GELU gate, Gemma 2's four norms and soft-capping, Gemma 3's local rotary base.
Packed rows, cached generation, exports and transformers' own Flax Gemma too."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from family_reference import (
    BASE,
    CONFIGS,
    MISTRAL,
    QWEN2,
    QWEN3,
    ROWS,
    hf_tensors,
    reference_logits,
    write_checkpoint,
)
from safetensors.numpy import load_file

from minifield.hf import checkpoint as hf_checkpoint
from minifield.hf import config as hf_config
from minifield.models import model

# one compiled program per config and row length; run op by op, the forward compiled each
# primitive, and each layer's scan afresh, in every test
forward = jax.jit(model.forward, static_argnums=1)


def packed_logits(cfg, params, tokens, segments, positions) -> np.ndarray:
    arrays = (jnp.asarray([x], jnp.int32) for x in (tokens, segments, positions))
    return np.asarray(forward(params, cfg, *arrays))[0]


def our_logits(cfg, params, row) -> np.ndarray:
    return packed_logits(cfg, params, row, [1] * len(row), list(range(len(row))))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, dict]:
    root = tmp_path_factory.mktemp("families")
    out = {}
    for n, (name, hf) in enumerate(CONFIGS.items()):
        tensors = hf_tensors(hf, seed=10 + n)
        out[name] = {
            "hf": hf,
            "tensors": tensors,
            "dir": write_checkpoint(root / name, hf, tensors),
        }
    return out


# -- what config.json means --------------------------------------------------------------------


def test_each_family_reads_its_fields():
    mistral = hf_config.config_from_hf(MISTRAL, max_len=32)
    assert (mistral.sliding_window, mistral.layer_types, mistral.qk_norm) == (4, (), False)
    qwen2 = hf_config.config_from_hf(QWEN2, max_len=32)
    assert qwen2.qkv_bias and qwen2.sliding_window == 5
    assert [qwen2.layer_window(i) for i in range(2)] == [None, 5]
    qwen3 = hf_config.config_from_hf(QWEN3, max_len=32)
    assert (qwen3.head_dim, qwen3.qk_norm, qwen3.qkv_bias, qwen3.sliding_window) == (
        12,
        True,
        False,
        None,
    )
    # transformers' defaults: Qwen3 head_dim 128; Qwen2 window only with use_sliding_window,
    # 4096 when the key is absent, on layers >= max_window_layers (absent: 28)
    bare = {k: v for k, v in QWEN3.items() if k != "head_dim"}
    assert hf_config.config_from_hf(bare, max_len=32).head_dim == 128
    assert hf_config.config_from_hf({**QWEN2, "use_sliding_window": False}).sliding_window is None
    every = {k: v for k, v in QWEN2.items() if k != "sliding_window"} | {"max_window_layers": 0}
    assert (
        hf_config.config_from_hf(every).sliding_window,
        hf_config.config_from_hf(every).layer_types,
    ) == (4096, ())
    assert hf_config.config_from_hf({**QWEN2, "max_window_layers": 2}).sliding_window is None
    # Mistral's window reaching every position is no window (its own v0.2+ configs)
    assert hf_config.config_from_hf({**MISTRAL, "sliding_window": 64}).sliding_window is None


# -- logits against the written equations --------------------------------------------------------


@pytest.mark.parametrize("name", list(CONFIGS))
def test_logits_match_the_written_equations(checkpoints, name):
    case = checkpoints[name]
    cfg, params = hf_checkpoint.load(case["dir"], max_len=32, compute_dtype="float32")
    for row in ROWS:
        np.testing.assert_allclose(
            our_logits(cfg, params, row),
            reference_logits(case["tensors"], case["hf"], row),
            atol=1e-4,
        )


def test_the_window_changes_the_logits(checkpoints):
    """The reference with and without the window differ on these rows: the test above could
    not pass with the window ignored."""
    case = checkpoints["mistral-window"]
    unwindowed = {**case["hf"], "sliding_window": None}
    windowed = reference_logits(case["tensors"], case["hf"], ROWS[0])
    assert np.abs(windowed - reference_logits(case["tensors"], unwindowed, ROWS[0])).max() > 1e-2


@pytest.mark.slow
@pytest.mark.parametrize("name", ["mistral-window", "qwen2-window-layer-1", "gemma3"])
def test_each_segment_of_a_packed_row_equals_the_example_alone(checkpoints, name):
    cfg, params = hf_checkpoint.load(checkpoints[name]["dir"], max_len=32, compute_dtype="float32")
    a, b, c = ROWS[0][:7], ROWS[1][:9], ROWS[0][3:8]
    tokens = a + b + c + [0, 0]
    segments = [1] * 7 + [2] * 9 + [3] * 5 + [0, 0]
    positions = list(range(7)) + list(range(9)) + list(range(5)) + [0, 1]
    packed = packed_logits(cfg, params, tokens, segments, positions)
    for example, start in ((a, 0), (b, 7), (c, 16)):
        # alone in a row as long as the packed one, padding (segment 0) after it, as
        # test_mixtral's: one compiled forward serves every call instead of one per length
        pad = len(tokens) - len(example)
        alone = packed_logits(
            cfg, params, example + [0] * pad, [1] * len(example) + [0] * pad,
            list(range(len(example))) + [0] * pad,
        )[: len(example)]  # fmt: skip
        np.testing.assert_allclose(packed[start : start + len(example)], alone, atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["mistral-window", "qwen3-window-tied", "gemma2", "gemma3"])
def test_cached_generation_follows_the_reference_argmax(checkpoints, name):
    """Greedy tokens with the key/value cache (windowed over cache slots) equal the argmax of
    the reference forward over the growing row, past the window."""
    case = checkpoints[name]
    cfg, params = hf_checkpoint.load(case["dir"], max_len=32, compute_dtype="float32")
    prompt, expected = ROWS[0][:5], []
    for _ in range(8):
        logits = reference_logits(case["tensors"], case["hf"], prompt + expected)
        expected.append(int(np.argmax(logits[-1])))
    assert model.greedy_generate(params, cfg, prompt, 8, None) == expected


# -- export ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(CONFIGS))
def test_export_then_load_gives_the_same_model_and_logits(checkpoints, tmp_path, name):
    case = checkpoints[name]
    cfg, params = hf_checkpoint.load(case["dir"], max_len=32, compute_dtype="float32")
    with_base, without = tmp_path / "with-base", tmp_path / "without"
    hf_checkpoint.write(with_base, cfg, params, base_config=case["hf"])
    assert json.loads((with_base / "config.json").read_text()) == {
        **case["hf"],
        "torch_dtype": "float32",
    }
    written = load_file(str(with_base / "model.safetensors"))
    assert sorted(written) == sorted(case["tensors"])
    for key, value in case["tensors"].items():
        np.testing.assert_array_equal(written[key], value, err_msg=key)
    # without a base config.json: the family config_to_hf picks reads back as the same model
    hf_checkpoint.write(without, cfg, params)
    again, params_again = hf_checkpoint.load(without, max_len=32, compute_dtype="float32")
    assert again == cfg
    assert (
        json.loads((without / "config.json").read_text())["model_type"] == case["hf"]["model_type"]
    )
    np.testing.assert_array_equal(
        our_logits(again, params_again, ROWS[1]), our_logits(cfg, params, ROWS[1])
    )


def test_to_dict_round_trips_and_leaves_out_what_is_unset(checkpoints):
    cfg = hf_config.config_from_hf(CONFIGS["qwen3-window-tied"], max_len=32)
    d = cfg.to_dict()
    assert d["head_dim"] == 12 and d["layer_types"] == ["sliding_attention", "full_attention"]
    assert model.config_from_dict(json.loads(json.dumps(d))) == cfg
    longrope = hf_config.config_from_hf(CONFIGS["phi3-longrope"], max_len=32)
    d = longrope.to_dict()
    assert d["fused_projections"] and d["rope_scaling"]["short_factor"] == [1.0, 1.3, 2.5, 6.0]
    assert model.config_from_dict(json.loads(json.dumps(d))) == longrope
    plain = hf_config.config_from_hf({**BASE, "model_type": "llama"}, max_len=32).to_dict()
    assert not {"head_dim", "qk_norm", "sliding_window", "layer_types"} & set(plain)


@pytest.mark.slow
def test_gemma_logits_and_greedy_tokens_equal_transformers_flax(checkpoints, monkeypatch):
    """transformers' own Flax Gemma (its rotary base is fixed at 10000, this config's)."""
    import test_llama
    import transformers

    class Gemma(transformers.FlaxGemmaForCausalLM):
        """transformers' Flax Gemma whose throw-away initial parameters are zeros of their
        shapes instead of a random init run op by op (~4 CPU-s of compiling): from_pretrained
        replaces every one with the file's tensor, and _flax_model checks that it did (a zero
        left in place fails that check as a random value would)."""

        def init_weights(self, rng, input_shape, params=None):
            assert params is None  # from_pretrained's initialisation only
            init = super().init_weights
            shapes = jax.eval_shape(lambda key: init(key, input_shape), rng)
            return jax.tree_util.tree_map(lambda s: np.zeros(s.shape, s.dtype), shapes)

    monkeypatch.setattr(test_llama, "_flax_class", lambda hf: Gemma)
    case = checkpoints["gemma"]
    assert case["hf"]["rope_theta"] == 10000.0
    reference = test_llama._flax_model(case["dir"], {**case["hf"], "tie_word_embeddings": True})
    cfg, params = hf_checkpoint.load(case["dir"], max_len=32, compute_dtype="float32")
    # their forward and generation each compiled as one program: called plainly, Flax runs
    # them op by op, compiling every primitive of every layer (about 370 small programs,
    # most of this test's time); the same functions of the same parameters either way
    theirs = jax.jit(lambda p, ids: reference(ids, params=p).logits)(
        reference.params, np.asarray(ROWS, np.int32)
    )
    for row, logits in zip(ROWS, np.asarray(theirs), strict=True):
        np.testing.assert_allclose(our_logits(cfg, params, row), logits, atol=1e-4)
    prompt = ROWS[0][:6]

    @jax.jit
    def generate(p, ids):
        return reference.generate(
            ids, params=p, max_new_tokens=6, do_sample=False, pad_token_id=0
        ).sequences

    generated = generate(reference.params, np.asarray([prompt], np.int32))
    assert (
        model.greedy_generate(params, cfg, prompt, 6, None)
        == np.asarray(generated)[0, len(prompt) :].tolist()
    )
