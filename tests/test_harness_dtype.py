"""The harness model's compute dtype and model arguments (``minifield.harness``).

An export declares its weights' dtype in ``config.json`` (``torch_dtype``); lm-eval's ``hf``
model scores a directory in it (``dtype=auto``), whatever precision the run trained in, and
so does ours: a BF16-compute run that exports FP32 weights is scored in FP32.

Reference: transformers' ``FlaxLlamaForCausalLM`` loading the same export in FP32
(from_pretrained, every parameter checked to be the file's tensor, its rotary base set to the
export's rope_theta), log-probabilities computed here in float64 numpy from its logits; the
byte tokenizer's definition (id = UTF-8 byte, ``<bos>`` 257). Each request is one token, so
the bound is per token.
"""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest
import test_llama
from test_hf_export import tiny_llama, write_packed_sft_export
from test_llama import _flax_model

BOS = 257
TEXTS = [
    "hello world",
    "abc -> cba",
    "xyzzy plugh",
    "reverse: abcdef -> fedcba",
    "é ü!",
    "the quick brown fox jumps over the lazy dog",
]


def _write(directory, compute_dtype="bfloat16", export_dtype="float32"):
    """A tiny Llama export of a ``compute_dtype`` run whose weights are stored (and declared
    in config.json) as ``export_dtype``. Weights twice the initialisation: log-probs of -3 to
    -25 a token (tiny_llama's three times gives logits so sharp that two FP32 forwards of
    it, transformers' and ours, differ from a float64 one by 1e-3)."""
    cfg, params = tiny_llama(compute_dtype)
    params = jax.tree_util.tree_map(lambda x: x / 3.0 * 2.0, params)
    write_packed_sft_export(directory, cfg, params, export_dtype)
    return directory


@pytest.fixture(scope="module")
def export(tmp_path_factory):
    return _write(tmp_path_factory.mktemp("harness-dtype") / "export")


def _one_token_requests():
    """``(context, next character)`` at every position of TEXTS with its place in the row
    (a context ending in a space is left out: lm-eval moves that space into the continuation)."""
    requests, places = [], []
    for number, text in enumerate(TEXTS):
        data = text.encode()
        for k in range(1, len(data)):
            try:
                context, continuation = data[:k].decode(), data[k : k + 1].decode()
            except UnicodeDecodeError:  # inside a multi-byte character
                continue
            if context == context.rstrip():
                requests.append((context, continuation))
                places.append((number, k))
    return requests, places


def _loglikelihoods(lm, pairs) -> np.ndarray:
    from lm_eval.api.instance import Instance

    requests = [Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(pairs)]
    return np.asarray([logp for logp, _ in lm.loglikelihood(requests)])


def _rows() -> np.ndarray:
    """``<bos> text`` of every text, right-padded into one batch (the models are causal: a
    position's logits do not see the padding after it)."""
    rows = [[BOS, *t.encode()] for t in TEXTS]
    out = np.zeros((len(rows), max(map(len, rows))), np.int32)
    for number, row in enumerate(rows):
        out[number, : len(row)] = row
    return out


def _log_softmax(logits) -> np.ndarray:
    logits = np.asarray(logits, np.float64)
    top = logits.max(-1, keepdims=True)
    return logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True))


def _per_token(log_probs_of_text, places) -> np.ndarray:
    """log p(byte k | <bos> bytes before k) for each place (text number, k)."""
    out = []
    for number, k in places:
        ids = [BOS, *TEXTS[number].encode()]
        out.append(log_probs_of_text[number][k, ids[k + 1]])
    return np.asarray(out)


@pytest.mark.slow  # a Flax build
def test_a_bf16_run_exported_as_float32_is_scored_in_float32_unless_asked(export, monkeypatch):
    from minifield import load_model
    from minifield.harness.model import MinifieldLM

    recorded = json.loads((export / "model.json").read_text())["config"]["model"]
    hf = json.loads((export / "config.json").read_text())
    assert (recorded["compute_dtype"], hf["torch_dtype"]) == ("bfloat16", "float32")
    test_llama.flax_rope_theta.__wrapped__(monkeypatch)(hf["rope_theta"])
    flax = _flax_model(export, hf)
    theirs = _log_softmax(flax(_rows(), params=flax.params).logits)
    pairs, places = _one_token_requests()
    reference = _per_token(theirs, places)
    assert len(reference) > 80 and reference.min() < -15  # sharp enough for BF16 to show

    default = MinifieldLM(path=str(export), batch_size=4)
    assert (default.loaded.dtype, default.cfg.compute_dtype) == ("float32", "float32")
    ours = _loglikelihoods(default, pairs)
    # the done-criterion: transformers' FP32 forward within 1e-4 per token (1.9e-5 measured)
    np.testing.assert_allclose(ours, reference, rtol=0, atol=1e-4)
    for dtype in ("auto", "float32"):
        lm = MinifieldLM(path=str(export), batch_size=4, dtype=dtype)
        np.testing.assert_array_equal(_loglikelihoods(lm, pairs), ours, err_msg=dtype)

    bf16 = MinifieldLM(path=str(export), batch_size=4, dtype="bfloat16")
    assert bf16.cfg.compute_dtype == "bfloat16"
    got = _loglikelihoods(bf16, pairs)
    # BF16: far from the FP32 reference (0.45 nats at worst measured) ...
    assert np.abs(got - reference).max() > 0.05
    # ... and our own BF16 forward's log-probs (load_model's logits, one row per text)
    model = load_model(export, compute_dtype="bfloat16")
    ours_bf16 = _log_softmax(model.logits(_rows()))
    np.testing.assert_allclose(got, _per_token(ours_bf16, places), rtol=0, atol=1e-4)
    # generation computes in the chosen dtype too
    assert bf16.loaded.cfg.compute_dtype == "bfloat16"
    assert default.loaded.cfg.compute_dtype == "float32"


@pytest.mark.parametrize(
    ("compute_dtype", "export_dtype", "scored_in"),
    [
        ("bfloat16", "float32", "float32"),
        ("float32", "bfloat16", "bfloat16"),  # BF16 weights declared bfloat16: as declared
        ("bfloat16", "float16", "float32"),  # no FP16 forward: FP16 weights are exact in FP32
    ],
)
def test_auto_is_the_declared_dtype(tmp_path, compute_dtype, export_dtype, scored_in):
    from minifield.harness import loading

    directory = _write(tmp_path / "export", compute_dtype, export_dtype)
    loaded = loading.load(directory)
    assert (loaded.dtype, loaded.cfg.compute_dtype) == (scored_in, scored_in)
    for asked in ("float32", "bfloat16"):
        assert loading.load(directory, asked).cfg.compute_dtype == asked


def test_a_config_without_a_dtype_declares_its_stored_tensors(tmp_path):
    from minifield.harness import loading
    from minifield.state import export

    directory = _write(tmp_path / "export", "float32", "bfloat16")
    config = json.loads((directory / "config.json").read_text())
    del config["torch_dtype"]
    (directory / "config.json").write_text(json.dumps(config))
    model_json = json.loads((directory / "model.json").read_text())["config"]
    assert loading.declared_dtype(directory, model_json) == "bfloat16"  # model.json's weights
    (directory / "config.json").write_text(json.dumps({**config, "dtype": "float16"}))
    assert loading.declared_dtype(directory, model_json) == "float16"  # transformers >= 4.56
    (directory / "config.json").write_text(json.dumps({**config, "torch_dtype": "float64"}))
    with pytest.raises(
        export.ExportError, match=r"config.json: declares dtype 'float64', expected one"
    ):
        loading.declared_dtype(directory, model_json)


def test_unknown_model_arguments_and_dtypes_are_refused_by_name(tmp_path):
    from minifield.harness.model import HarnessModelError, MinifieldLM

    directory = str(tmp_path / "none")  # nothing is loaded before the arguments are checked
    with pytest.raises(HarnessModelError) as refused:
        MinifieldLM.create_from_arg_string(f"path={directory},dtpye=float32")
    assert str(refused.value) == (
        "unknown model argument 'dtpye' (did you mean 'dtype'?): the minifield model takes "
        "path, dtype, batch_size, add_bos_token, cache, max_gen_toks"
    )
    with pytest.raises(HarnessModelError, match=r"^unknown model arguments 'pretrained', 'x': "):
        MinifieldLM(pretrained="gpt2", x=1)
    for dtype in ("float16", "fp32", None):
        with pytest.raises(HarnessModelError) as refused:
            MinifieldLM(path=directory, dtype=dtype)
        assert str(refused.value) == (
            f"model argument dtype={dtype!r}: expected auto, float32, bfloat16 "
            "(auto: the export's declared dtype)"
        )
    with pytest.raises(HarnessModelError, match=r"^model argument path=EXPORT_DIR is required"):
        MinifieldLM(dtype="float32")


def test_what_lm_eval_passes_every_model_is_accepted(export):
    from minifield.harness.model import MinifieldLM

    # simple_evaluate's additional_config: batch_size, max_batch_size and device (None dropped)
    settings = {"batch_size": "4", "max_batch_size": 64, "device": "cuda:0"}
    lm = MinifieldLM.create_from_arg_string(f"path={export},dtype=bfloat16", settings)
    assert (lm.batch_size, lm.cfg.compute_dtype) == (4, "bfloat16")
    lm = MinifieldLM.create_from_arg_obj({"path": str(export)}, {**settings, "device": None})
    assert (lm.batch_size, lm.cfg.compute_dtype) == (4, "float32")
