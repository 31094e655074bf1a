"""two-stage's data beyond JSONL pairs: a stage-1 corpus in Parquet (a ``text`` column), and
``training.train_on`` in stage 2 with packed-sft's meaning.

References: the same documents written as JSONL (the corpus read from Parquet must prepare
the same arrays), the texts as written here, packed-sft's own preparation of the same
conversations with the same ``train_on`` (the claim is "the same meaning"), and the trained
tokens of the last assistant turn counted by hand from the messages.
"""

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from test_two_stage import _pin, export_stage1, pretrain_recipe, sft_recipe

import minifield
from minifield import recipe as recipes
from minifield.inputs.pinned import files_by_name
from minifield.strategies.two_stage import corpus

TEXTS = ["the quick brown fox", "  ", "jumps over the lazy dog", "ünïcode døcument"]


def _parquet_bytes(tmp_path, table: pa.Table, name: str) -> bytes:
    path = tmp_path / f"{name}.parquet"
    pq.write_table(table, path)
    return path.read_bytes()


def _prepared(recipe: dict, root) -> dict:
    checked = recipes.validate(recipe)
    return checked.strategy.prepare(checked.data, files_by_name(checked.data, root))[0]


def test_a_parquet_corpus_prepares_what_its_jsonl_twin_does(tmp_path):
    import pandas as pd

    jsonl = "".join(json.dumps({"text": t}) + "\n" for t in TEXTS).encode()
    by_pyarrow = _parquet_bytes(
        tmp_path, pa.table({"id": list(range(len(TEXTS))), "text": TEXTS}), "arrow"
    )
    frame = tmp_path / "pandas.parquet"
    pd.DataFrame({"text": TEXTS, "url": ["u"] * len(TEXTS)}).to_parquet(frame)
    by_pandas = frame.read_bytes()
    reference = _prepared(
        pretrain_recipe(
            {s: _pin(tmp_path, f"j/{s}.jsonl", jsonl) for s in ("train", "dev", "test")}
        ),
        tmp_path,
    )
    for name, data in (("arrow", by_pyarrow), ("pandas", by_pandas)):
        # no .parquet suffix needed: Parquet is told by its content, as for supervised files
        pins = {s: _pin(tmp_path, f"{name}/{s}.data", data) for s in ("train", "dev", "test")}
        assert corpus.read_documents(tmp_path / pins["dev"][0]) == [TEXTS[0], *TEXTS[2:]]
        arrays = _prepared(pretrain_recipe(pins), tmp_path)
        for key in [k for k in reference if k != "dev_file"]:
            np.testing.assert_array_equal(arrays[key], reference[key], err_msg=f"{name} {key}")


@pytest.mark.parametrize(
    ("table", "needle"),
    [
        (pa.table({"body": ["a"]}), "has no 'text' column (columns ['body'])"),
        (pa.table({"text": [1, 2]}), "Parquet column 'text' holds int64, expected strings"),
        (pa.table({"text": ["a", None]}), '(row 1): "text" is null, expected a string'),
        (pa.table({"text": ["", " "]}), "empty corpus"),
    ],
)
def test_a_bad_parquet_corpus_is_refused_naming_the_file(tmp_path, table, needle):
    data = _parquet_bytes(tmp_path, table, "bad")
    pins = {s: _pin(tmp_path, f"c/{s}.parquet", data) for s in ("train", "dev", "test")}
    with pytest.raises(corpus.CorpusError) as raised:
        _prepared(pretrain_recipe(pins), tmp_path)
    assert str(raised.value).startswith(str(tmp_path / "c" / "train.parquet"))
    assert needle in str(raised.value)


@pytest.mark.slow  # trains, exports and re-evaluates (~15 s): the slow tier
def test_a_parquet_dev_corpus_travels_in_the_export_and_is_reevaluated_from_it(tmp_path):
    data = _parquet_bytes(tmp_path, pa.table({"text": TEXTS}), "dev")
    pins = {s: _pin(tmp_path, f"c/{s}.parquet", data) for s in ("train", "dev", "test")}
    recipe = pretrain_recipe(pins)
    export = export_stage1(tmp_path, recipe, tmp_path / "export")
    assert (export / "dev.parquet").read_bytes() == data
    checked = recipes.validate(recipe)
    figures = checked.strategy.evaluate_export(checked.data, export)
    program = checked.strategy.build(checked.data, _prepared(recipe, tmp_path))
    own = program.evaluate(program.init_state())
    assert figures["dev_loss"] == pytest.approx(own["dev_loss"], rel=1e-6)
    assert figures["dev_bytes"] == sum(len(t.encode()) for t in TEXTS if t.strip())


# -- train_on in stage 2 -------------------------------------------------------------------

CONVERSATIONS = [
    [("system", "be brief"), ("user", "hi"), ("assistant", "hello"), ("user", "name?"),
     ("assistant", "fox"), ("user", "again"), ("assistant", "fox!")],
    [("user", "abc"), ("assistant", "cba"), ("user", "xyz"), ("assistant", "zyx")],
]  # fmt: skip


def _conversation_pins(root) -> dict:
    rows = [{"messages": [{"role": r, "content": c} for r, c in turns]} for turns in CONVERSATIONS]
    data = "".join(json.dumps(row) + "\n" for row in rows).encode()
    return {s: _pin(root, f"chat/{s}.jsonl", data) for s in ("train", "dev", "test")}


def _with_train_on(recipe: dict, train_on: str | None) -> dict:
    recipe["training"]["seq_len"] = 128  # a whole conversation in a row
    if train_on is not None:
        recipe["training"]["train_on"] = train_on
    return recipe


@pytest.mark.parametrize("train_on", [None, "last_assistant", "everything"])
def test_stage2_train_on_means_what_it_means_for_packed_sft(tmp_path, train_on):
    pins = _conversation_pins(tmp_path)
    two_stage = _prepared(_with_train_on(sft_recipe(pins), train_on), tmp_path)
    packed = _with_train_on(sft_recipe(pins), train_on)
    packed["strategy"] = {"name": "packed-sft", "version": "12.0.0"}
    del packed["training"]["stage"]
    reference = _prepared(packed, tmp_path)
    for key in ("train_tokens", "train_segments", "train_positions", "train_loss_mask"):
        np.testing.assert_array_equal(two_stage[key], reference[key], err_msg=key)
    trained = int(two_stage["train_loss_mask"].sum())
    if train_on == "last_assistant":  # by hand: the last reply's bytes and its <eos>
        assert trained == sum(len(turns[-1][1].encode()) + 1 for turns in CONVERSATIONS)
    else:  # more than the last turn: every assistant turn, or every token but the first
        assert trained > sum(len(turns[-1][1].encode()) + 1 for turns in CONVERSATIONS)


def test_stage2_train_on_is_in_the_digests_and_refused_for_stage1(tmp_path):
    pins = _conversation_pins(tmp_path)
    plain = recipes.validate(_with_train_on(sft_recipe(pins), None))
    spelled = recipes.validate(_with_train_on(sft_recipe(pins), "all_assistant"))
    assert spelled.computation_digest == plain.computation_digest  # the absent value
    assert spelled.examples_digest == plain.examples_digest
    last = recipes.validate(_with_train_on(sft_recipe(pins), "last_assistant"))
    assert last.computation_digest != plain.computation_digest
    assert last.examples_digest != plain.examples_digest
    stage1 = pretrain_recipe({s: _pin(tmp_path, f"c/{s}.txt", b"text") for s in pins})
    assert minifield.validate(stage1).errors == []
    refused = minifield.validate(_with_train_on(stage1, "last_assistant"))
    assert [(e["path"], e["message"]) for e in refused.errors] == [
        (
            "/training/train_on",
            "only for training.stage sft (stage 1 trains every token of its documents)",
        )
    ]
