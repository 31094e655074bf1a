"""The lm-eval model's request bookkeeping (:mod:`minifield.harness.model`), fast: the export,
the forward and the generation are replaced by small Python stand-ins whose answers are known
in closed form, so which positions a log-likelihood sums, how rows are cut, batched, padded
and put back in request order, and how generation requests are grouped, filled, cut at stop
sequences and refused are checked against expectations computed here from the requests alone.

``tests/test_harness.py`` (slow) runs the real model against transformers' numbers.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from minifield.harness import loading
from minifield.harness import model as harness_model
from minifield.harness.model import HarnessModelError, MinifieldLM, cut_at_stop

BOS, EOS = 257, 258


class ByteTokenizer:
    """id = UTF-8 byte; ``<bos>`` 257, ``<eos>`` 258 (as the slow tests' export); a text
    starting with ``<bos>`` encodes it as its id."""

    def __init__(self, bos_id=BOS):
        self.bos_id, self.eos_id = bos_id, EOS

    def encode(self, text: str) -> list[int]:
        if text.startswith("<bos>"):
            return [BOS, *text[5:].encode()]
        return list(text.encode())

    def decode(self, ids) -> str:
        return bytes(i for i in ids if i < 256).decode(errors="replace")


def _lm(monkeypatch, max_len=40, bos_id=BOS, **arguments) -> MinifieldLM:
    fake = loading.Loaded(
        Path("export"), None, SimpleNamespace(max_len=max_len), ByteTokenizer(bos_id), None
    )
    monkeypatch.setattr(loading, "load", lambda path, *a, **k: fake)
    monkeypatch.setattr(loading, "scoring_config", lambda cfg, *a, **k: cfg)
    return MinifieldLM("export", **arguments)


def _row_logp(position: int, previous: int, target: int) -> float:
    """The stand-in model's log p(target | row up to position): known in closed form."""
    return -0.01 * ((previous * 31 + target * 7 + position * 3) % 97) - 0.001


def _greedy(target: int) -> bool:
    """The stand-in's argmax: even targets."""
    return target % 2 == 0


@pytest.fixture
def forward_calls(monkeypatch):
    """Replaces the jitted forward by :func:`_row_logp` over the rows; records the shapes."""
    calls = []

    def fake_score_rows(params, cfg, inputs_BxT, targets_BxT):
        inputs, targets = np.asarray(inputs_BxT), np.asarray(targets_BxT)
        calls.append(inputs.shape)
        B, T = inputs.shape
        logp = np.array(
            [[_row_logp(t, inputs[b, t], targets[b, t]) for t in range(T)] for b in range(B)]
        )
        return logp, (targets % 2 == 0)

    monkeypatch.setattr(harness_model, "_score_rows", fake_score_rows)
    return calls


def _expected_score(context, continuation, max_len):
    """Sum of log p over the continuation's tokens, the row being the last ``max_len + 1``
    tokens of context + continuation (positions counted in that row)."""
    whole = (list(context) + list(continuation))[-(max_len + 1) :]
    scored = min(len(continuation), len(whole) - 1)
    total, greedy = 0.0, True
    for p in range(len(whole) - scored, len(whole)):  # row index of each scored target
        total += _row_logp(p - 1, whole[p - 1], whole[p])
        greedy &= _greedy(whole[p])
    return total, greedy


def test_scores_sum_the_continuation_of_each_request_in_request_order(monkeypatch, forward_calls):
    lm = _lm(monkeypatch, max_len=40, batch_size=2)
    pairs = [
        ([BOS, 1, 2, 3], [4, 6]),
        ([BOS, 9], [5]),
        ([BOS, *range(10, 45)], [8, 10, 12]),  # 39 tokens: fits max_len + 1 = 41
        ([BOS, *range(50, 90)], [20, 21]),  # 43 tokens: the first two are cut
        ([BOS], list(range(100, 150))),  # a continuation longer than max_len: its last 40
    ]
    results = lm.score_tokens(pairs)
    assert len(results) == len(pairs)
    for (context, continuation), (logp, greedy) in zip(pairs, results, strict=True):
        want_logp, want_greedy = _expected_score(context, continuation, 40)
        assert logp == pytest.approx(want_logp, abs=1e-9)
        assert greedy is want_greedy
    # batches of batch_size rows (the last filled with padding rows), longest rows first, each
    # padded to a multiple of 32 positions but never past max_len
    assert forward_calls == [(2, 40), (2, 40), (2, 32)]


def test_an_empty_continuation_is_refused(monkeypatch, forward_calls):
    lm = _lm(monkeypatch)
    with pytest.raises(HarnessModelError, match="empty continuation"):
        lm.score_tokens([([BOS, 1], [])])


def test_rolling_loglikelihood_predicts_every_token_once_from_its_predecessor(
    monkeypatch, forward_calls
):
    """A document of 100 bytes under max_len 40: every byte is predicted once, the first from
    the prefix token (``<bos>``; the end-of-sequence token when the tokenizer has none),
    so with a stand-in whose log p depends on the previous token and the target only, the total
    is the sum over the document's bytes."""

    def fake_score_rows(params, cfg, inputs_BxT, targets_BxT):
        inputs, targets = np.asarray(inputs_BxT), np.asarray(targets_BxT)
        logp = np.vectorize(lambda p, t: _row_logp(0, p, t))(inputs, targets)
        return logp, (targets % 2 == 0)

    monkeypatch.setattr(harness_model, "_score_rows", fake_score_rows)
    documents = ["".join(chr(97 + (i * 7) % 26) for i in range(100)), "hi"]
    for bos_id, prefix in ((BOS, BOS), (None, EOS)):
        lm = _lm(monkeypatch, max_len=40, bos_id=bos_id, batch_size=3)
        requests = [SimpleNamespace(args=(text,)) for text in documents]
        totals = lm.loglikelihood_rolling(requests)
        for text, total in zip(documents, totals, strict=True):
            ids = list(text.encode())
            previous = [prefix, *ids[:-1]]
            want = sum(_row_logp(0, p, t) for p, t in zip(previous, ids, strict=True))
            assert total == pytest.approx(want, abs=1e-9)


# -- generation ---------------------------------------------------------------------------------


@pytest.fixture
def generate_calls(monkeypatch):
    """Replaces generation: each prompt's continuation spells its last byte three times, then
    ``|stop|`` and more text; records every batch (prompts, budget, cache)."""
    calls = []

    def fake_generate(loaded, prompts, max_new, cache):
        calls.append(([list(p) for p in prompts], max_new, cache))
        return [list((chr(p[-1]) * 3 + "|stop|tail").encode())[:max_new] for p in prompts]

    monkeypatch.setattr(loading, "generate", fake_generate)
    return calls


def _generation(context: str, **kwargs):
    return SimpleNamespace(args=(context, kwargs))


def test_generation_cuts_at_the_earliest_stop_and_keeps_request_order(monkeypatch, generate_calls):
    lm = _lm(monkeypatch, max_len=40, batch_size=2, max_gen_toks=20)
    requests = [
        _generation("ab", until=["|"]),
        _generation("a longer prompt x", until="tail"),  # a string is one stop sequence
        _generation("cd", until=["tail", "|", ""]),  # the earliest of several; "" stops nothing
        _generation("ef", until=[]),  # none: the whole budget
        _generation("gh", max_gen_toks=4),  # another budget: another batch
    ]
    out = lm.generate_until(requests)
    assert out == ["bbb", "xxx|stop|", "ddd", "fff|stop|tail", "hhh|"]
    budgets = [(len(prompts), max_new) for prompts, max_new, _ in generate_calls]
    # budget 20: three requests in batches of 2 (the last filled), budget 4: one batch of 2
    assert sorted(budgets) == [(2, 4), (2, 20), (2, 20)]
    for prompts, _, cache in generate_calls:
        assert cache is True
        assert all(p[0] == BOS for p in prompts)  # contexts begin with <bos>, as training did
    filled = next(prompts for prompts, max_new, _ in generate_calls if max_new == 4)
    assert filled[1] == filled[0] == [BOS, *b"gh"]  # the filler repeats the first prompt


def test_a_long_context_keeps_its_last_tokens_within_the_room_left(monkeypatch, generate_calls):
    lm = _lm(monkeypatch, max_len=40, batch_size=1, max_gen_toks=30)
    lm.generate_until([_generation("0123456789abcdefghij")])  # 21 tokens with <bos>, room 10
    ((prompts, max_new, _),) = generate_calls
    assert max_new == 30 and prompts == [list(b"abcdefghij")]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"do_sample": True}, "generates greedily"),
        ({"do_sample": "true"}, "generates greedily"),
        ({"temperature": 0.7}, "generates greedily"),
        ({"max_gen_toks": 40}, "max_gen_toks=40 leaves no room for a context"),
    ],
)
def test_sampling_and_a_budget_without_room_are_refused(
    monkeypatch, generate_calls, kwargs, message
):
    lm = _lm(monkeypatch, max_len=40, max_gen_toks=5)
    with pytest.raises(HarnessModelError, match=message):
        lm.generate_until([_generation("ab", **kwargs)])
    assert generate_calls == []


def test_greedy_settings_spelled_out_are_accepted(monkeypatch, generate_calls):
    lm = _lm(monkeypatch, max_len=40, max_gen_toks=5)
    settings = {"do_sample": False, "temperature": 0, "max_gen_toks": 39}
    assert lm.generate_until([_generation("ab", **settings)]) == ["bbb|stop|tail"]
    assert generate_calls[0][1] == 39


def test_cut_at_stop_cuts_at_the_earliest_of_any_stop():
    assert cut_at_stop("abcXdefYgh", ("Y", "X")) == "abc"
    assert cut_at_stop("abcXdefYgh", ("Y",)) == "abcXdef"
    assert cut_at_stop("abc", ("", "z")) == "abc"
    assert cut_at_stop("abc", ()) == "abc"


# -- arguments and tokens -----------------------------------------------------------------------


def test_model_arguments_are_parsed_and_bad_ones_named(monkeypatch):
    lm = _lm(monkeypatch, batch_size="3", add_bos_token="False", cache="no", max_gen_toks=" 7 ")
    assert (lm.batch_size, lm.add_bos_token, lm.cache, lm.max_gen_toks) == (3, False, False, 7)
    for auto in (None, "auto"):
        assert _lm(monkeypatch, batch_size=auto).batch_size == 8
    lm = _lm(monkeypatch)
    assert (lm.batch_size, lm.add_bos_token, lm.cache, lm.max_gen_toks) == (8, True, True, 64)
    for flag in ("TRUE", "yes", "1", True):
        assert _lm(monkeypatch, cache=flag).cache is True
    for flag in ("false", "NO", "0", False):
        assert _lm(monkeypatch, cache=flag).cache is False
    for bad in ("0", "-1", "2.5", 2.0, True, "two"):
        with pytest.raises(HarnessModelError, match=r"^model argument batch_size="):
            _lm(monkeypatch, batch_size=bad)
    with pytest.raises(HarnessModelError, match=r"^model argument cache='maybe': expected"):
        _lm(monkeypatch, cache="maybe")


def test_contexts_get_one_bos_unless_asked_not_to(monkeypatch):
    lm = _lm(monkeypatch)
    assert lm.tok_encode("ab") == [BOS, 97, 98]
    assert lm.tok_encode("ab", add_special_tokens=False) == [97, 98]
    assert lm.tok_encode("") == [BOS]
    assert lm.tok_encode("<bos>ab") == [BOS, 97, 98]  # one, not two
    assert lm.prefix_token_id == BOS and lm.eot_token_id == EOS and lm.max_length == 40
    plain = _lm(monkeypatch, add_bos_token=False)
    assert plain.tok_encode("ab") == [97, 98]
    assert plain.tok_encode("ab", add_special_tokens=True) == [BOS, 97, 98]
    assert _lm(monkeypatch, bos_id=None).prefix_token_id == EOS
    assert _lm(monkeypatch, bos_id=None).tok_encode("ab") == [97, 98]
