"""Preference pairs: rows read and checked, rendered with the demo base's chat template, packed
two segments per pair (never split), and per-answer log-probabilities from one packed forward
checked against one pair per row and against the float64 NumPy forward of
tests/family_reference.py on the demo base's own tensors."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import numpy as np
import pytest
from conftest import REPO
from family_reference import reference_logits
from safetensors.numpy import load_file

from minifield.data.formats import DataError
from minifield.hf import checkpoint as hf_checkpoint
from minifield.hf import pinned_base
from minifield.strategies.preference import logprobs, losses, pairs

BASE = REPO / "data" / "llama-base"
SEQ_LEN = 64

ROWS = [
    {"prompt": "abc", "chosen": "cba", "rejected": "cab"},
    {"prompt": "hello", "chosen": [{"role": "assistant", "content": "olleh"}], "rejected": "oll"},
    {"messages": [{"role": "user", "content": "xyzzy"}], "chosen": "yzzyx", "rejected": "yzzy"},
    {"prompt": [{"role": "user", "content": "kite"}], "chosen": "etik", "rejected": "tike"},
    {"prompt": "ab", "chosen": {"role": "assistant", "content": "ba"}, "rejected": "abba"},
    {"prompt": "mnop", "chosen": "ponm", "rejected": "pomn"},
    {"prompt": "q", "chosen": "q", "rejected": "qq"},
]


@pytest.fixture(scope="module")
def chat():
    recipe = {"model": {"base": {}}, "training": {"seq_len": SEQ_LEN}}
    config = json.loads((BASE / "config.json").read_text())
    return pinned_base.tokenizer_and_template(
        recipe,
        (BASE / "tokenizer.json").read_bytes(),
        (BASE / "tokenizer_config.json").read_bytes(),
        {"tokenizer": "tokenizer.json", "tokenizer_config": "tokenizer_config.json"},
        config["vocab_size"],
    )


@pytest.fixture(scope="module")
def encoded(chat):
    return pairs.encode([pairs.pair(r, f"rows:{i + 1}") for i, r in enumerate(ROWS)], *chat)


def _pair_file(tmp_path: Path, rows) -> Path:
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_each_shape_renders_as_the_template_writes_a_user_turn_and_its_answer(chat, encoded):
    """The demo template, by hand: ``<bos> user <sep>`` then ``answer <eos>``."""
    tokenizer, _ = chat

    def ids(text):
        return tokenizer.encode(text)

    answers = [("cba", "cab"), ("olleh", "oll"), ("yzzyx", "yzzy"), ("etik", "tike")]
    for (chosen, rejected), row, got in zip(answers, ROWS, encoded, strict=False):
        prompt = row.get("prompt", row.get("messages"))
        user = prompt if isinstance(prompt, str) else prompt[0]["content"]
        sep = tokenizer.backend.token_to_id("<sep>")
        assert got.prompt == [tokenizer.bos_id, *ids(user), sep]
        assert got.chosen == [*ids(chosen), tokenizer.eos_id]
        assert got.rejected == [*ids(rejected), tokenizer.eos_id]


def test_a_pair_is_two_segments_of_one_row_and_only_answer_tokens_are_masked(encoded, chat):
    packed = pairs.pack(encoded, 32, "reject", chat[0].pad_id)
    a = packed.rows
    seen = []
    for row in range(packed.stats["rows"]):
        for slot, index in enumerate(a.pair_index[row]):
            if index < 0:
                assert not np.any(np.isin(a.segments[row], [2 * slot + 1, 2 * slot + 2]))
                continue
            seen.append(int(index))
            p = encoded[index]
            for side, answer in enumerate((p.chosen, p.rejected)):
                where = a.segments[row] == 2 * slot + side + 1
                assert a.tokens[row][where].tolist() == p.prompt + answer
                assert a.positions[row][where].tolist() == list(range(len(p.prompt + answer)))
                mask = a.loss_mask[row][where]
                assert mask.tolist() == [0.0] * len(p.prompt) + [1.0] * len(answer)
            # the rejected segment follows the chosen one directly: no padding between
            starts = [np.flatnonzero(a.segments[row] == 2 * slot + s)[0] for s in (1, 2)]
            assert starts[1] - starts[0] == len(p.prompt) + len(p.chosen)
    assert sorted(seen) == list(range(len(encoded)))  # every pair once, none split
    assert packed.stats["rows"] < len(encoded)  # several pairs share a row
    assert packed.stats["answer_tokens"] == sum(len(p.chosen) + len(p.rejected) for p in encoded)


def test_overlong_pairs_are_cut_longer_answer_first_or_dropped_and_counted(encoded, chat):
    longest = max(len(p) for p in encoded)
    p = encoded[1]  # prompt 7, chosen 6, rejected 4: 24 tokens
    cut, outcome = pairs.fit(p, 20, "truncate")  # answer room 6: rejected 3 (half), chosen 3
    assert outcome == "truncated" and (cut.chosen, cut.rejected) == (p.chosen[:3], p.rejected[:3])
    cut, outcome = pairs.fit(p, 22, "truncate")  # room 8: rejected keeps 4, chosen 4
    assert (cut.chosen, cut.rejected) == (p.chosen[:4], p.rejected)
    assert pairs.fit(p, 15, "truncate") == (None, "rejected")  # room 1: an answer keeps none
    dropped = pairs.pack(encoded, longest - 1, "reject", chat[0].pad_id).stats
    too_long = sum(len(q) > longest - 1 for q in encoded)
    assert (dropped["rejected"], dropped["packed"]) == (too_long, len(encoded) - too_long)


@pytest.mark.parametrize(
    ("row", "needle"),
    [
        ({"prompt": "ab", "chosen": "ba", "rejected": "ba"}, "'chosen' equals 'rejected'"),
        ({"prompt": "ab", "chosen": "", "rejected": "ba"}, "chosen[0].content is empty"),
        ({"prompt": "ab", "chosen": "ba"}, "missing field 'rejected'"),
        ({"chosen": "ba", "rejected": "ab"}, "missing field 'prompt'"),
        ({"prompt": "ab", "chosen": ["ba", "b"], "rejected": "a"}, "a list of 2"),
        ({"prompt": "ab", "chosen": "ba", "rejected": "a", "score": 1}, "['score']"),
        (
            {"prompt": [{"role": "assistant", "content": "x"}], "chosen": "a", "rejected": "b"},
            "'prompt' ends with an assistant message",
        ),
    ],
)
def test_bad_rows_are_refused_naming_file_row_and_field(tmp_path, row, needle):
    path = _pair_file(tmp_path, [ROWS[0], row])
    with pytest.raises(DataError) as caught:
        pairs.read(path)
    assert f"{path}:2" in str(caught.value) and needle in str(caught.value)


def test_parquet_and_jsonl_files_read_as_the_same_pairs(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"prompt": r, "chosen": r[::-1], "rejected": r} for r in ("abc", "defg")]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "pairs.parquet")
    assert (
        pairs.read(tmp_path / "pairs.parquet")
        == [pairs.pair(r, f"{tmp_path / 'pairs.parquet'} (row {i})") for i, r in enumerate(rows)]
        and len(pairs.read(_pair_file(tmp_path, rows))) == 2
    )


# -- log-probabilities ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model():
    return hf_checkpoint.load(BASE, SEQ_LEN, "float32")


def _per_pair(model, packed):
    cfg, params = model
    batch = jax.tree_util.tree_map(jax.numpy.asarray, packed.rows)
    out = {k: np.asarray(v) for k, v in logprobs.answer_logps(params, cfg, batch).items()}
    by_pair = {}
    for row, slots in enumerate(packed.rows.pair_index):
        for slot, index in enumerate(slots):
            if index >= 0:
                by_pair[int(index)] = {k: out[k][row, slot] for k in out}
    return by_pair


def _numpy_answer_logp(prompt, answer):
    """Σ log p(answer token | everything before it), float64, from the HF tensors."""
    hf = json.loads((BASE / "config.json").read_text())
    tensors = load_file(BASE / "model.safetensors")
    ids = prompt + answer
    logits = reference_logits(tensors, hf, ids)
    logp = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True))
    logp -= logits.max(-1, keepdims=True)
    return sum(logp[t - 1, ids[t]] for t in range(len(prompt), len(ids)))


# 25-40 s of compiling on this machine: in the slow tier, so the fast tier stays a quick loop
@pytest.mark.slow
def test_packed_log_probs_equal_one_pair_per_row_and_the_numpy_forward(model, encoded, chat):
    pad = chat[0].pad_id
    packed = _per_pair(model, pairs.pack(encoded, SEQ_LEN, "reject", pad))
    for index, p in enumerate(encoded):
        alone = _per_pair(model, pairs.pack([p], SEQ_LEN, "reject", pad))[0]
        for key in ("chosen", "rejected", "chosen_len", "rejected_len"):
            np.testing.assert_allclose(packed[index][key], alone[key], rtol=1e-5, atol=1e-5)
        assert packed[index]["chosen_len"] == len(p.chosen)
        assert packed[index]["rejected_len"] == len(p.rejected)
        want = [_numpy_answer_logp(p.prompt, a) for a in (p.chosen, p.rejected)]
        np.testing.assert_allclose(
            [packed[index]["chosen"], packed[index]["rejected"]], want, atol=1e-4, rtol=0
        )
    # the losses of the packed and the one-per-row log-probabilities agree too
    settings = losses.LossSettings("simpo", beta=2.0, gamma=0.5)
    singles = [_per_pair(model, pairs.pack([p], SEQ_LEN, "reject", pad))[0] for p in encoded]

    def mean_loss(values):
        arrays = {k: np.asarray([v[k] for v in values], np.float32) for k in values[0]}
        return float(losses.batch_loss(settings, arrays, np.ones(len(values)))[0])

    np.testing.assert_allclose(
        mean_loss([packed[i] for i in range(len(encoded))]), mean_loss(singles), rtol=1e-5
    )
