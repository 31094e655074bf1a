"""Greedy generation with a key/value cache (Llama models).

References: the same model's generation without a cache (the full forward over the buffer
for every token), its full forward's logits at every generated position, and transformers'
``FlaxLlamaForCausalLM`` / ``FlaxMistralForCausalLM`` greedy ``generate`` (its own cache) on
tiny random HF checkpoints. Every test compiles generation loops (10-20 s on 2 cores): slow tier.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import test_llama
from conftest import in_production_programs
from test_llama import _flax_model

from minifield.hf import checkpoint as hf_checkpoint
from minifield.models import llama, model

pytestmark = pytest.mark.slow

checkpoints = test_llama.checkpoints  # the module fixture: tiny random HF checkpoints
flax_rope_theta = test_llama.flax_rope_theta

CASES = {
    "gqa-bias-untied-f32": dict(n_kv_heads=2, qkv_bias=True, compute_dtype="float32"),
    "mqa-tied-f32": dict(n_kv_heads=1, tie_embeddings=True, compute_dtype="float32"),
    "gqa-bias-untied-bf16": dict(n_kv_heads=2, qkv_bias=True, compute_dtype="bfloat16"),
}


def tiny(seed=3, **changes):
    cfg = llama.LlamaConfig(
        **{
            "vocab_size": 67,
            "d_model": 32,
            "n_layers": 2,
            "n_heads": 4,
            "n_kv_heads": 2,
            "d_ff": 48,
            "max_len": 40,
            "rope_theta": 20000.0,
            **changes,
        }
    )
    params = llama.init_params(cfg, jax.random.key(seed))
    return cfg, jax.tree_util.tree_map(lambda x: x * 3.0, params)


def prompts(seed=0, lengths=(1, 4, 9, 17)):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 67, n).tolist() for n in lengths]


@pytest.mark.parametrize("name", list(CASES))
def test_cached_tokens_equal_uncached_tokens(name):
    cfg, params = tiny(**CASES[name])
    # Four prompts and a fifth that nearly fills max_len, in one batch: each generation
    # program (cached and uncached) is compiled once, for five rows, and serves the runs
    # without and with a stop token (its ids are traced values).
    batch = prompts() + prompts(1, (36,))
    cached = model.greedy_generate_batch(params, cfg, batch, 18, None, cache=True)
    plain = model.greedy_generate_batch(params, cfg, batch, 18, None, cache=False)
    for row, (a, b) in enumerate(zip(cached, plain, strict=True)):
        assert a == b, f"row {row}: first difference at token " + str(
            next(i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y)
        )
    # 18 new tokens each, but the long prompt stops where it fills max_len
    assert [len(x) for x in cached] == [18] * 4 + [40 - 36]
    # a stop token that occurs ends each row at the same place; one prompt fills max_len
    stop = cached[2][5]
    assert model.greedy_generate_batch(
        params, cfg, batch, 18, stop, cache=True
    ) == model.greedy_generate_batch(params, cfg, batch, 18, stop, cache=False)
    alone = model.greedy_generate(params, cfg, batch[-1], 18, None)
    assert len(alone) == 40 - 36 and alone == cached[-1]


def test_each_cached_step_gives_the_full_forward_logits_at_that_position():
    # within FP32 rounding of the programs users run: compiled lightly (this process), the two
    # programs' logits differ by up to 1.4e-4, past the tolerance measured at production's
    in_production_programs(cached_steps_give_the_full_forward_logits)


def cached_steps_give_the_full_forward_logits() -> None:
    """Each cached generation step's logits are the full forward's at that position."""
    cfg, params = tiny(**CASES["gqa-bias-untied-f32"])
    prompt = prompts(lengths=(5,))[0]
    # 28 new tokens: a buffer of max_len (5 + 28 rounds up past it), one row, so the program is
    # the one the first case's single-prompt run compiled (the same config and shapes)
    new = model.greedy_generate(params, cfg, prompt, 28, None)
    assert len(new) == 28
    sequence = prompt + new
    L = cfg.max_len
    tokens = jnp.asarray([sequence + [0] * (L - len(sequence))], jnp.int32)
    positions = jnp.arange(L, dtype=jnp.int32)[None]
    # one compiled forward, not the model op by op (each primitive compiled on its own)
    forward = jax.jit(model.forward, static_argnums=1)
    full = np.asarray(forward(params, cfg, tokens, jnp.ones_like(tokens), positions))[0]

    step = jax.jit(llama.forward_cached, static_argnums=1)
    logits, cache = step(
        params, cfg, tokens.at[0, len(prompt) :].set(0), positions, llama.empty_cache(cfg, 1, L),
        jnp.asarray([len(prompt) - 1]),
    )  # fmt: skip
    np.testing.assert_allclose(np.asarray(logits)[0], full[len(prompt) - 1], rtol=1e-5, atol=1e-4)
    for t in range(len(prompt), len(sequence)):
        logits, cache = step(
            params, cfg, tokens[:, t : t + 1], jnp.asarray([[t]]), cache, jnp.asarray([0])
        )
        np.testing.assert_allclose(np.asarray(logits)[0], full[t], rtol=1e-5, atol=1e-4)
        assert int(np.argmax(full[t - 1])) == sequence[t]


@pytest.mark.parametrize("name", test_llama.FLAX_CASES)
def test_cached_generation_equals_transformers_flax_greedy(checkpoints, flax_rope_theta, name):
    case = checkpoints[name]
    flax_rope_theta(case["hf"]["rope_theta"])
    reference = _flax_model(case["dir"], case["hf"])
    cfg, params = hf_checkpoint.load(case["dir"], max_len=64, compute_dtype="float32")
    # transformers' generate compiled as one program per prompt length (their documented
    # `jax.jit(model.generate)`), not dispatched op by op: the same greedy tokens
    generate = jax.jit(
        lambda ids: (
            reference.generate(ids, max_new_tokens=16, do_sample=False, pad_token_id=0).sequences
        )
    )
    for prompt in (test_llama.ROWS[0][:5], test_llama.ROWS[1]):
        generated = generate(np.asarray([prompt], np.int32))
        expected = np.asarray(generated)[0, len(prompt) :].tolist()
        assert model.greedy_generate(params, cfg, prompt, 16, None, cache=True) == expected
