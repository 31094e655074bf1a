"""Rollouts (minifield.rl.rollouts): draws from the filtered softmax at the right frequencies,
each row's tokens a function of (seed, update, prompt, completion) alone, greedy decoding
(the rollouts' and the model's generation, one decode loop) against a naive full-forward
decode, and the per-token log-probabilities the objective reads against a NumPy log-softmax
of the model's logits."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from test_generation_cache import tiny

from minifield.models import model
from minifield.models.sampling import Sampling
from minifield.rl import logprobs, rollouts

#: the model's forward compiled once per shape: run op by op, each of its primitives is
#: compiled on its own. (The log-probabilities test below keeps both sides op by op: its
#: bfloat16 model, compiled, rounds differently in the two programs, beyond its bound.)
_forward = jax.jit(model.forward, static_argnums=1)


def _filtered_probs(logits: np.ndarray, temperature: float, top_k: int, top_p: float):
    """transformers' warpers by hand, in float64: temperature, top-k, then the nucleus."""
    scaled = logits.astype(np.float64) / temperature
    order = np.argsort(-scaled, kind="stable")
    keep = np.zeros(scaled.shape, bool)
    keep[order[: top_k or len(scaled)]] = True
    p = np.exp(scaled - scaled[keep].max()) * keep
    p /= p.sum()
    cumulative = 0.0
    nucleus = np.zeros_like(keep)
    for i in order:
        if not keep[i]:
            continue
        if cumulative < top_p or top_p >= 1:
            nucleus[i] = True
        cumulative += p[i]
    p = np.exp(scaled - scaled[nucleus].max()) * nucleus
    return p / p.sum()


@pytest.mark.slow  # compile-heavy for the fast tier (10 CPU-s there); the full suite runs it
@pytest.mark.parametrize("settings", [(1.0, 0, 1.0), (0.7, 12, 1.0), (1.3, 0, 0.8)])
def test_first_token_frequencies_are_within_5_sigma_of_the_filtered_softmax(settings):
    temperature, top_k, top_p = settings
    cfg, params = tiny(seed=5)
    params = jax.tree_util.tree_map(lambda x: x / 3.0, params)  # a spread-out distribution
    prompt = [3, 17, 42, 8]
    n = 4000
    ids, _ = rollouts.generate(
        params, cfg, [prompt] * n, 1, (),
        sampling=Sampling(temperature, top_k, top_p), seed=7, update=2,
        prompt_index=np.zeros(n, np.int64), completion_index=np.arange(n),
    )  # fmt: skip
    drawn = np.bincount([row[0] for row in ids], minlength=cfg.vocab_size) / n
    logits = np.asarray(_forward(params, cfg, *_row(prompt)))[0, len(prompt) - 1]
    expected = _filtered_probs(logits, temperature, top_k, top_p)
    sigma = np.sqrt(expected * (1 - expected) / n)
    assert np.all(np.abs(drawn - expected) <= 5 * sigma + 1e-12), (drawn, expected)
    assert drawn[expected == 0].sum() == 0  # nothing outside the kept tokens


def _row(prompt):
    t = np.asarray([prompt], np.int32)
    return t, np.ones_like(t), np.arange(len(prompt), dtype=np.int32)[None]


def test_each_rows_key_is_the_documented_chain_of_fold_ins():
    # the module's rule, one row at a time with Python ints: key(seed), then the updates
    # before this one (update 9: 8), the prompt and the completion folded in, in that order
    prompt_index, completion_index = np.asarray([10, 10, 3, 7]), np.asarray([0, 1, 1, 5])
    keys = rollouts.row_keys(41, 9, prompt_index, completion_index)
    pairs = zip(prompt_index.tolist(), completion_index.tolist(), strict=True)
    for n, (p, c) in enumerate(pairs):
        key = jax.random.fold_in(jax.random.fold_in(jax.random.key(41), 8), p)
        by_hand = jax.random.key_data(jax.random.fold_in(key, c))
        assert np.array_equal(jax.random.key_data(keys[n]), by_hand)
    assert len({tuple(np.asarray(jax.random.key_data(k)).tolist()) for k in keys}) == 4
    with pytest.raises(ValueError, match="numbered from 1, got update 0"):
        rollouts.row_keys(41, 0, prompt_index, completion_index)


@pytest.mark.slow  # compile-heavy for the fast tier (7 CPU-s there); the full suite runs it
def test_a_rows_tokens_depend_on_its_keys_alone_not_on_its_batch():
    cfg, params = tiny(seed=5)
    params = jax.tree_util.tree_map(lambda x: x / 3.0, params)
    prompts = [[3, 4, 5], [9, 1], [7, 7, 7, 7, 2]]
    sampling = Sampling(1.0, 0, 1.0)
    together = rollouts.sample_groups(
        params, cfg, prompts, [10, 11, 12], 3, max_new=8, stops=(0,), sampling=sampling,
        seed=4, update=6, length=20,
    )  # fmt: skip
    # prompt 11 alone, its group in reverse order, in a longer buffer
    alone, _ = rollouts.generate(
        params, cfg, [prompts[1]] * 3, 8, (0,), sampling=sampling, seed=4, update=6,
        prompt_index=[11, 11, 11], completion_index=[2, 1, 0], length=32,
    )  # fmt: skip
    assert alone == together.completion_ids[3:6][::-1]
    # another update, seed or completion index draws otherwise
    other, _ = rollouts.generate(
        params, cfg, [prompts[1]] * 3, 8, (0,), sampling=sampling, seed=4, update=7,
        prompt_index=[11, 11, 11], completion_index=[2, 1, 0], length=32,
    )  # fmt: skip
    assert other != alone
    assert len({tuple(c) for c in together.completion_ids}) > 3


def _naive_greedy(params, cfg, prompt, n, stops):
    """Reference: the full forward over the sequence so far (no cache; the slots after it
    padding, segment 0), its argmax at the last slot, until a stop token (kept) or n tokens."""
    sequence = list(prompt)
    while len(sequence) < len(prompt) + n:
        row = np.zeros((1, cfg.max_len), np.int32)
        row[0, : len(sequence)] = sequence
        segments = (np.arange(cfg.max_len) < len(sequence)).astype(np.int32)[None]
        positions = np.arange(cfg.max_len, dtype=np.int32)[None]
        logits = np.asarray(_forward(params, cfg, row, segments, positions))
        sequence.append(int(np.argmax(logits[0, len(sequence) - 1])))
        if sequence[-1] in stops:
            break
    return sequence[len(prompt) :]


@pytest.mark.slow  # compile-heavy for the fast tier (5 CPU-s there); the full suite runs it
def test_both_callers_of_the_decode_loop_give_the_naive_decodes_greedy_tokens():
    cfg, params = tiny(seed=3, compute_dtype="float32")
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8], [9]]  # [9]: one token, the shortest prompt
    expected = [_naive_greedy(params, cfg, p, 10, ()) for p in prompts]
    mine, truncated = rollouts.generate(params, cfg, prompts, 10, (), length=24)
    assert mine == expected and truncated.all()
    # the model's generation (Llama: the cache; the GPT model's full forward: test_model.py)
    assert model.greedy_generate_batch(params, cfg, prompts, 10, None) == expected
    # a stop token ends a row where the reference stops: kept by the rollouts, dropped by
    # the model's generation
    stop = expected[0][3]
    stopped = [_naive_greedy(params, cfg, p, 10, (stop,)) for p in prompts]
    cut, truncated = rollouts.generate(params, cfg, prompts, 10, (stop,), length=24)
    assert cut == stopped and cut[0][-1] == stop and not truncated[0]
    theirs = model.greedy_generate_batch(params, cfg, prompts, 10, stop)
    assert theirs == [row[:-1] if row[-1:] == [stop] else row for row in stopped]
    # an empty prompt has no logits to choose its first token from: refused by both
    with pytest.raises(ValueError, match="every prompt needs at least one token"):
        rollouts.generate(params, cfg, [[1, 2], []], 10, (), length=24)
    with pytest.raises(ValueError, match="every prompt needs at least one token"):
        model.greedy_generate_batch(params, cfg, [[1, 2], []], 10, None)


@pytest.mark.slow  # compile-heavy for the fast tier (5 CPU-s there); the full suite runs it
def test_token_logps_are_the_temperature_scaled_log_softmax_of_the_previous_slot():
    cfg, params = tiny(seed=2)
    tokens = np.asarray([[3, 9, 14, 2, 0, 0], [5, 5, 6, 7, 8, 1]], np.int32)
    logps, entropy = logprobs.token_logps(params, cfg, tokens, 0.8)
    segments = np.ones_like(tokens)
    positions = np.broadcast_to(np.arange(6, dtype=np.int32), tokens.shape)
    logits = np.asarray(model.forward(params, cfg, tokens, segments, positions), np.float64) / 0.8
    shifted = logits - logits.max(-1, keepdims=True)
    log_softmax = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
    for n in range(2):
        for t in range(1, 6):
            assert logps[n, t] == pytest.approx(log_softmax[n, t - 1, tokens[n, t]], abs=2e-5)
            p = np.exp(log_softmax[n, t - 1])
            assert entropy[n, t] == pytest.approx(-(p * log_softmax[n, t - 1]).sum(), abs=2e-4)
    assert np.all(np.asarray(logps)[:, 0] == 0)
