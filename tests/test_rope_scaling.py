"""Llama ``rope_scaling`` (``llama3``, ``linear``, ``dynamic``) and exports that keep the base
model's ``config.json``.

The reference is a float64 NumPy Llama forward written below from the published equations,
sharing no code with the project: the plain rotary frequencies ``theta^(-2i/K)``; linear
scaling divides them (the same as dividing the positions); Llama 3.1's smoothing keeps the
wavelengths shorter than ``original / high_freq_factor``, divides those longer than
``original / low_freq_factor`` by ``factor`` and interpolates between; dynamic NTK multiplies
the base by ``(factor L / max_pos - (factor - 1))^(K / (K - 2))`` with ``L`` the sequence
length, never less than ``max_pos``. The checkpoints are random tensors under HF's names
(``test_llama.hf_tensors``), their ``config.json`` written by hand.
"""

from __future__ import annotations

import hashlib
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import read_events, run_worker, write_recipe
from test_base_model import BASE, _prepare, base_recipe, make_inputs
from test_llama import LLAMA, hf_tensors, write_checkpoint

from minifield.hf import checkpoint as hf_checkpoint
from minifield.hf.checkpoint import CheckpointError
from minifield.models import model

#: head size 16 (8 frequencies) and theta 100: wavelengths 6.3, 11.2, 19.9, 35.3, ... positions
HF = {**LLAMA, "hidden_size": 64, "rope_theta": 100.0, "max_position_embeddings": 128}
#: with original 16: below 16/2 = 8 kept (6.3), 8..16 smoothed (11.2), above 16 divided
LLAMA3 = {
    "rope_type": "llama3",
    "factor": 4.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 2.0,
    "original_max_position_embeddings": 16,
}
SCALINGS = {
    "llama3": LLAMA3,
    "linear": {"type": "linear", "factor": 3.0},  # the legacy key
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
}
T = 64  # positions 0..63: four times original_max_position_embeddings


def reference_inv_freq(hf: dict, length: int) -> np.ndarray:
    K = hf["hidden_size"] // hf["num_attention_heads"]
    theta, scaling = hf["rope_theta"], hf.get("rope_scaling") or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "dynamic":
        max_pos = hf["max_position_embeddings"]
        longest = max(length, max_pos)
        theta *= (scaling["factor"] * longest / max_pos - (scaling["factor"] - 1)) ** (K / (K - 2))
    freq = theta ** -(np.arange(0, K, 2, dtype=np.float64) / K)
    if kind == "linear":
        return freq / scaling["factor"]
    if kind != "llama3":
        return freq
    wavelength = 2 * np.pi / freq
    original = scaling["original_max_position_embeddings"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    out = freq.copy()
    for i, wave in enumerate(wavelength):
        if wave > original / low:
            out[i] = freq[i] / scaling["factor"]
        elif wave >= original / high:
            s = (original / wave - low) / (high - low)
            out[i] = (1 - s) * freq[i] / scaling["factor"] + s * freq[i]
    return out


def reference_logits(t: dict, hf: dict, ids) -> np.ndarray:
    """HF Llama's forward for one row, float64."""
    t = {k: v.astype(np.float64) for k, v in t.items()}
    H, G, L = hf["num_attention_heads"], hf["num_key_value_heads"], len(ids)
    K = hf["hidden_size"] // H
    angle = np.outer(np.arange(L), reference_inv_freq(hf, L))  # [L, K/2]
    cos, sin = np.cos(angle), np.sin(angle)

    def rotate(x):  # [L, heads, K]: pairs (i, i + K/2) turned by angle i
        a, b = x[..., : K // 2], x[..., K // 2 :]
        c, s = cos[:, None], sin[:, None]
        return np.concatenate([a * c - b * s, b * c + a * s], -1)

    def norm(x, w):
        return w * x / np.sqrt((x**2).mean(-1, keepdims=True) + hf["rms_norm_eps"])

    x = t["model.embed_tokens.weight"][list(ids)]
    for n in range(hf["num_hidden_layers"]):
        w = {k.split(f"layers.{n}.")[1]: v for k, v in t.items() if f"layers.{n}." in k}
        h = norm(x, w["input_layernorm.weight"])
        q = rotate((h @ w["self_attn.q_proj.weight"].T).reshape(L, H, K))
        k = rotate((h @ w["self_attn.k_proj.weight"].T).reshape(L, G, K))
        v = (h @ w["self_attn.v_proj.weight"].T).reshape(L, G, K)
        heads = []
        for head in range(H):
            kv = head * G // H
            score = q[:, head] @ k[:, kv].T / np.sqrt(K)
            score[np.triu_indices(L, 1)] = -np.inf
            p = np.exp(score - score.max(1, keepdims=True))
            heads.append((p / p.sum(1, keepdims=True)) @ v[:, kv])
        x = x + np.concatenate(heads, 1) @ w["self_attn.o_proj.weight"].T
        h = norm(x, w["post_attention_layernorm.weight"])
        gate, up = h @ w["mlp.gate_proj.weight"].T, h @ w["mlp.up_proj.weight"].T
        x = x + (gate * up / (1 + np.exp(-gate))) @ w["mlp.down_proj.weight"].T
    return norm(x, t["model.norm.weight"]) @ t["lm_head.weight"].T


_forward = jax.jit(model.forward, static_argnums=1)


def our_logits(cfg, params, ids) -> np.ndarray:
    tokens = jnp.asarray([ids], jnp.int32)
    positions = jnp.arange(len(ids), dtype=jnp.int32)[None]
    return np.asarray(_forward(params, cfg, tokens, jnp.ones_like(tokens), positions))[0]


IDS = [int(i) for i in np.random.default_rng(3).integers(0, LLAMA["vocab_size"], T)]


@pytest.fixture(scope="module")
def tensors():
    return hf_tensors(HF, seed=11)


def _load(tmp_path, hf: dict, tensors, max_len: int = T):
    return hf_checkpoint.load(write_checkpoint(tmp_path, hf, tensors), max_len, "float32")


def test_the_reference_without_scaling_matches_the_existing_rotary(tmp_path, tensors):
    cfg, params = _load(tmp_path, HF, tensors)
    assert cfg.rope_scaling == ()
    np.testing.assert_allclose(
        our_logits(cfg, params, IDS), reference_logits(tensors, HF, IDS), atol=1e-4
    )


def test_the_llama3_case_exercises_all_three_frequency_bands():
    wavelength = 2 * np.pi / reference_inv_freq(HF, T)
    assert (wavelength < 8).sum() == 1  # kept
    assert ((wavelength >= 8) & (wavelength <= 16)).sum() == 1  # smoothed
    assert (wavelength > 16).sum() == 6  # divided; wavelengths up to T matter at 64 positions
    scaled = reference_inv_freq({**HF, "rope_scaling": LLAMA3}, T)
    plain = reference_inv_freq(HF, T)
    assert scaled[0] == plain[0] and plain[1] / 4 < scaled[1] < plain[1]
    np.testing.assert_allclose(scaled[2:], plain[2:] / 4)


@pytest.mark.parametrize("name", list(SCALINGS))
def test_scaled_rotary_matches_the_written_equations(tmp_path, tensors, name):
    hf = {**HF, "rope_scaling": SCALINGS[name]}
    cfg, params = _load(tmp_path, hf, tensors)
    assert dict(cfg.rope_scaling)["factor"] == SCALINGS[name]["factor"]
    ours = our_logits(cfg, params, IDS)
    np.testing.assert_allclose(ours, reference_logits(tensors, hf, IDS), atol=1e-4)
    if name != "dynamic":  # the scaling really changes the function (dynamic: not below max_pos)
        assert np.abs(ours - reference_logits(tensors, HF, IDS)).max() > 1e-2


@pytest.mark.parametrize(
    ("scaling", "message"),
    [
        ({"rope_type": "yarn", "factor": 4.0}, "rope_scaling.rope_type 'yarn' is not supported"),
        ({"type": "longrope"}, "rope_scaling.long_factor missing (rope_type 'longrope' needs it)"),
        ({"factor": 2.0}, "rope_scaling.rope_type None is not supported"),
        ({**LLAMA3, "beta_fast": 32}, "rope_scaling.beta_fast is not supported for rope_type"),
        ({"type": "linear"}, "rope_scaling.factor missing (rope_type 'linear' needs it)"),
        ({**LLAMA3, "factor": "8"}, "rope_scaling.factor must be a positive number, found '8'"),
        (
            {**LLAMA3, "original_max_position_embeddings": 16.0},
            "rope_scaling.original_max_position_embeddings must be a positive integer",
        ),
        (
            {**LLAMA3, "high_freq_factor": 1.0},
            "rope_scaling.high_freq_factor must exceed rope_scaling.low_freq_factor",
        ),
        ([], "rope_scaling must be an object, found a list"),
    ],
)
def test_unsupported_rope_scaling_is_refused_naming_the_file_and_field(tmp_path, scaling, message):
    hf = {**HF, "rope_scaling": scaling}
    with pytest.raises(CheckpointError) as err:
        hf_checkpoint.config_from_hf(hf, str(tmp_path / "config.json"), T)
    assert str(err.value).startswith(f"{tmp_path / 'config.json'}: ")
    assert message in str(err.value)


def test_dynamic_scaling_beyond_max_position_embeddings_is_refused():
    hf = {**HF, "max_position_embeddings": 32, "rope_scaling": SCALINGS["dynamic"]}
    with pytest.raises(CheckpointError, match="rope_type 'dynamic' with rows of 64 positions"):
        hf_checkpoint.config_from_hf(hf, "config.json", T)
    # within it, the rows see exactly transformers' (unscaled) frequencies
    np.testing.assert_array_equal(reference_inv_freq(hf, 32), reference_inv_freq(HF, 32))


# -- exports keep the base model's config.json ------------------------------------------------

#: a Llama 3 style base: longer context than the run's rows, scaling, token ids, extra fields
LONG_BASE = {
    **BASE,
    "max_position_embeddings": 256,
    "rope_scaling": {**LLAMA3, "original_max_position_embeddings": 32},
    "bos_token_id": 300,
    "eos_token_id": [301, 302],
    "attention_dropout": 0.0,
    "pretraining_tp": 1,
    "transformers_version": "4.57.6",
    "torch_dtype": "bfloat16",
    "a_field_this_project_never_reads": {"kept": [1, 2]},
}
#: what a run may change in config.json: the stored dtype (float32: the recipes' default)
ALLOWED_DIFFERENCES = {"torch_dtype": "float32"}


#: Llama 3 instruct's: a list of eos ids, sampling settings, a max_length beyond seq_len
GENERATION = {
    "bos_token_id": 300,
    "eos_token_id": [301, 302],
    "do_sample": True,
    "temperature": 0.6,
    "top_p": 0.9,
    "max_length": 256,
}


@pytest.fixture
def long_base(tmp_path):
    root = tmp_path / "inputs"
    make_inputs(root)
    (root / "base" / "config.json").write_text(json.dumps(LONG_BASE))
    return root


def _with_generation_config(recipe: dict, root) -> dict:
    """``recipe`` with the base model's ``generation_config.json`` pinned too."""
    path = root / "base" / "generation_config.json"
    path.write_text(json.dumps(GENERATION, indent=1))
    sha = hashlib.sha256(path.read_bytes()).hexdigest()
    recipe["inputs"].append({"name": "base-generation", "path": "base/generation_config.json"})
    recipe["inputs"][-1]["sha256"] = sha
    recipe["model"]["base"]["generation_config"] = "base-generation"
    return recipe


# a full fine-tune's export in the slow tier: the fast tier keeps the LoRA one
@pytest.mark.parametrize("lora", [pytest.param(False, marks=pytest.mark.slow), True])
def test_an_export_keeps_every_field_of_the_base_config(long_base, tmp_path, lora):
    model_section = {"lora": {"rank": 2}} if lora else {}
    recipe = _with_generation_config(base_recipe(long_base, model_section), long_base)
    loaded, (arrays, _) = _prepare(recipe, long_base)
    program = loaded.strategy.build(loaded.data, arrays)
    state = program.init_state()
    directory = tmp_path / "export"
    program.export(state, directory)
    exported = json.loads((directory / "config.json").read_text())
    assert sorted(exported) == sorted(LONG_BASE)
    for field, value in LONG_BASE.items():
        assert exported[field] == ALLOWED_DIFFERENCES.get(field, value), field
    for name in ("generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (directory / name).read_bytes() == (long_base / "base" / name).read_bytes(), name
    # it loads back (the project's loader, at the run's rows) to the model the run evaluated
    from minifield.strategies.lm.export_format import ExportedModel

    back = ExportedModel(directory)
    assert back.cfg == program.cfg and back.cfg.max_len == 64
    ours = our_logits(back.cfg, back.params, IDS)
    reference = our_logits(program.cfg, program._eval_params(state), IDS)
    np.testing.assert_array_equal(ours, reference)


@pytest.mark.slow
def test_a_llama3_scaled_base_fine_tunes_in_the_worker(long_base, tmp_path):
    path = write_recipe(tmp_path / "recipe.json", base_recipe(long_base))
    run_worker(job=path, input_root=long_base, output_root=tmp_path / "out", check_codes=(0,))
    (attempt,) = (tmp_path / "out" / "base-test").iterdir()
    result = json.loads((attempt / "result.json").read_text())
    assert result["status"] == "completed" and result["steps_completed"] == 4
    losses = [e["loss"] for e in read_events(attempt / "events.jsonl") if e["type"] == "update"]
    assert len(losses) == 4 and all(np.isfinite(losses))
    exported = json.loads((attempt / "export" / "config.json").read_text())
    assert exported["rope_scaling"] == LONG_BASE["rope_scaling"]


def test_a_pinned_generation_config_that_is_not_an_object_is_refused_naming_it(long_base):
    from minifield.hf.pinned_base import BaseModelError

    recipe = _with_generation_config(base_recipe(long_base), long_base)
    path = long_base / "base" / "generation_config.json"
    path.write_text("[1]")
    recipe["inputs"][-1]["sha256"] = hashlib.sha256(path.read_bytes()).hexdigest()
    with pytest.raises(BaseModelError, match=f"^{path}: expected a JSON object$"):
        _prepare(recipe, long_base)
