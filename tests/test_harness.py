"""The lm-evaluation-harness model backed by minifield (``minifield.harness``).

Reference: transformers' ``FlaxLlamaForCausalLM`` loading the same export (from_pretrained,
every parameter checked to be the file's tensor; its rotary base set to the export's
rope_theta), with log-probabilities, rolling windows, greedy decoding and multiple-choice
accuracy computed here in float64 numpy from its logits. The byte tokenizer is its definition:
id = UTF-8 byte, ``<bos>`` 257, ``<eos>`` 258. A Flax build takes ~10 s: slow tier.
"""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest
import test_llama
from test_hf_export import _write_export
from test_llama import _flax_model

pytestmark = pytest.mark.slow

BOS, EOS = 257, 258


@pytest.fixture(scope="module")
def export(tmp_path_factory):
    directory = tmp_path_factory.mktemp("harness") / "export"
    cfg, _ = _write_export(directory)
    return directory, cfg


@pytest.fixture(scope="module")
def reference(export):
    """log_softmax of transformers' logits for a token row (float64)."""
    directory, _ = export
    hf = json.loads((directory / "config.json").read_text())
    with pytest.MonkeyPatch.context() as patch:
        test_llama.flax_rope_theta.__wrapped__(patch)(hf["rope_theta"])
        flax = _flax_model(directory, hf)
        width = hf["max_position_embeddings"]
        # Every row runs at one width, compiled once: run op by op at each row's own length,
        # transformers' model compiled every operation again per length (the greedy reference
        # below asks for ~40 lengths: minutes). The model is causal, so a position's logits do
        # not depend on the tokens padded after it; checked here with two different paddings.
        logits_of = jax.jit(lambda params, ids_1xW: flax(ids_1xW, params=params).logits[0])

        def logits_TxV(ids: list[int], pad: int = 0) -> np.ndarray:
            assert len(ids) <= width, (len(ids), width)
            row = np.full((1, width), pad, np.int32)
            row[0, : len(ids)] = ids
            return np.asarray(logits_of(flax.params, row)[: len(ids)], np.float64)

        probe = [BOS, *_bytes("causal?")]
        assert np.array_equal(logits_TxV(probe), logits_TxV(probe, pad=EOS))

        def log_probs(ids: list[int]) -> np.ndarray:
            logits = logits_TxV(ids)
            return (
                logits
                - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1))[:, None]
                - logits.max(-1)[:, None]
            )

        yield log_probs


@pytest.fixture(scope="module")
def lm(export):
    from minifield.harness.model import MinifieldLM

    return MinifieldLM(path=str(export[0]), batch_size=4)


def _requests(kind, *args):
    from lm_eval.api.instance import Instance

    return [Instance(kind, {}, a, i) for i, a in enumerate(args)]


def _bytes(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def test_loglikelihood_equals_transformers_log_probs(lm, reference):
    pairs = [("hello", " world"), ("abc ->", " cba"), ("x", "yzzy"), ("", "start"), ("é", "ü!")]
    ours = lm.loglikelihood(_requests("loglikelihood", *pairs))
    for (context, continuation), (logp, greedy) in zip(pairs, ours, strict=True):
        ids = [BOS, *_bytes(context + continuation)]
        first = 1 + len(_bytes(context))
        logp_TxV = reference(ids)
        per_token = [logp_TxV[t - 1, ids[t]] for t in range(first, len(ids))]
        # 1e-4 per token (the FP32 bound of the logits comparison in test_hf_export); these
        # sharp random logits give log-probs of -20 to -30 a token
        assert logp == pytest.approx(sum(per_token), abs=1e-4 * len(per_token)), context
        assert greedy == all(
            int(np.argmax(logp_TxV[t - 1])) == ids[t] for t in range(first, len(ids))
        )


def test_rolling_loglikelihood_is_the_sum_over_disjoint_windows(lm, reference, export):
    max_len = export[1].max_len  # 48
    text = "".join(chr(ord("a") + (i * 7) % 26) for i in range(130))  # 130 tokens: 3 windows
    ids = _bytes(text)
    expected = 0.0
    # token j is predicted once: in window 0 from <bos> ids[:j], in window k >= 1 from the
    # max_len tokens before the window's last prediction (windows of max_len predictions)
    for start in range(0, len(ids), max_len):
        end = min(start + max_len, len(ids))
        if start == 0:
            row, offset = [BOS, *ids[: end - 1]], 0
        else:
            row = ids[end - 1 - max_len : end - 1]
            offset = end - 1 - max_len
        logp_TxV = reference(row)
        for j in range(start, end):
            position = j - offset if start == 0 else j - 1 - offset
            expected += logp_TxV[position, ids[j]]
    (ours,) = lm.loglikelihood_rolling(_requests("loglikelihood_rolling", (text,)))
    assert ours == pytest.approx(expected, abs=1e-4 * len(ids))  # 1e-4 per token, as above


def _greedy(reference, context: str, budget: int) -> str:
    """Token-by-token greedy decoding from transformers' logits, ended by <eos>."""
    ids = [BOS, *_bytes(context)]
    new = []
    for _ in range(budget):
        token = int(np.argmax(reference(ids + new)[-1]))
        if token == EOS:
            break
        new.append(token)
    return bytes(t for t in new if t < 256).decode("utf-8", errors="replace")


def test_generate_until_stops_at_the_stop_sequence_as_greedy_decoding_would(lm, reference):
    contexts = ["reverse: abc ->", "hello", "xyz"]
    full = [_greedy(reference, c, 12) for c in contexts]
    assert all(len(text) >= 6 for text in full), full  # room for a stop sequence inside
    settings = [{"until": [], "max_gen_toks": 12}] * 3
    assert (
        lm.generate_until(_requests("generate_until", *zip(contexts, settings, strict=True)))
        == full
    )
    stops = [text[3:5] for text in full]
    requests = [
        (c, {"until": [s], "max_gen_toks": 12}) for c, s in zip(contexts, stops, strict=True)
    ]
    cut = lm.generate_until(_requests("generate_until", *requests))
    assert cut == [text[: text.index(s)] for text, s in zip(full, stops, strict=True)]
    # max_gen_toks bounds the tokens (5 bytes here: no multi-byte character in them)
    short = lm.generate_until(_requests("generate_until", ("xyz", {"max_gen_toks": 5})))
    assert short == [_greedy(reference, "xyz", 5)]


def test_shipped_multiple_choice_accuracy_equals_one_computed_by_hand(export, reference, repo):
    from minifield.harness import run, tasks

    harness = {"tasks": [{"name": "minifield_reverse_mc", "config": "c", "data": "d"}]}
    files = {
        "c": repo / "data/harness/reverse_mc.yaml",
        "d": repo / "data/harness/reverse_mc.jsonl",
    }
    resolved = [tasks.resolve(harness["tasks"][0], files)]
    settings = {"num_fewshot": 0, "limit": None, "max_gen_toks": 8}
    results = run.evaluate(export[0], resolved, settings, batch_size=8)
    docs = [json.loads(line) for line in files["d"].read_text().splitlines()]
    right = 0
    for doc in docs:
        context = f"reverse: {doc['prompt']} ->"
        scores = []
        for choice in doc["choices"]:
            ids = [BOS, *_bytes(f"{context} {choice}")]
            logp_TxV = reference(ids)
            first = 1 + len(_bytes(context))
            scores.append(sum(logp_TxV[t - 1, ids[t]] for t in range(first, len(ids))))
        right += int(np.argmax(scores)) == doc["label"]
    assert results["samples"] == {"minifield_reverse_mc": len(docs)}
    assert results["dtype"] == "float32"  # the export's declared dtype
    assert results["results"]["minifield_reverse_mc"]["acc"] == pytest.approx(right / len(docs))
