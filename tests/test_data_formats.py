"""Supervised data in the formats people have: each read into the same examples as its
``messages`` equivalent (written by hand here), JSONL and Parquet (pandas and pyarrow), the
format declared or detected and recorded, a column mapping, and bad files refused naming the
file, the row and the field with nothing prepared kept."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
from conftest import TINY_SFT, merged, packed_sft_recipe, read_events, run_attempt, write_recipe

from minifield import recipe as recipes
from minifield.data import encoding
from minifield.data import formats as data_formats
from minifield.data import tokenizer as tk
from minifield.pipeline import preparation

SYSTEM, Q1, A1, Q2, A2 = "be brief", "reverse: abc", "cba", "and xyz?", "zyx"
#: the conversation every format below spells, as OpenAI messages
MESSAGES = [
    {"role": "system", "content": SYSTEM},
    {"role": "user", "content": Q1},
    {"role": "assistant", "content": A1},
    {"role": "user", "content": Q2},
    {"role": "assistant", "content": A2},
]
SHAREGPT = [
    {"from": "system", "value": SYSTEM},
    {"from": "human", "value": Q1},
    {"from": "gpt", "value": A1},
    {"from": "human", "value": Q2},
    {"from": "gpt", "value": A2},
]
ALPACA = {"instruction": "reverse", "input": "abc", "output": "cba"}
ALPACA_MESSAGES = [
    {"role": "user", "content": "reverse\n\nabc"},
    {"role": "assistant", "content": "cba"},
]
CHATML = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + "
    "'<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def _jsonl(path: Path, rows) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def _encoded(path: Path, source=None, tokenizer=None):
    tokenizer = tokenizer or tk.byte_tokenizer()
    return [encoding.encode(e, tokenizer) for e in data_formats.read(path, source).examples]


@pytest.fixture(scope="module")
def chat(tmp_path_factory):
    """A byte-level BPE tokenizer with ChatML's specials, and ChatML: the template path."""
    from test_chat_template import SPECIALS, make_tokenizer
    from tokenizers import Tokenizer

    from minifield.data import chat_template

    path = make_tokenizer(tmp_path_factory.mktemp("tok") / "tokenizer.json", specials=SPECIALS)
    tokenizer, strings = tk.from_base_model(
        path.read_bytes(), {"eos_token": "<|im_end|>"}, "tokenizer.json", "tokenizer_config.json"
    )
    assert isinstance(tokenizer.backend, Tokenizer)
    return tokenizer, chat_template.ChatTemplate(CHATML, strings, "chatml")


def _templated(path: Path, chat, source=None):
    from minifield.hf import pinned_base

    tokenizer, template = chat
    read = data_formats.read(path, source)
    return pinned_base.encode_chat(read.examples, tokenizer, template, "all_assistant", path)


@pytest.mark.parametrize(
    ("fmt", "row", "messages"),
    [
        ("sharegpt", {"conversations": SHAREGPT}, MESSAGES),
        ("alpaca", ALPACA, ALPACA_MESSAGES),
        ("alpaca", {"instruction": "reverse abc", "output": "cba"}, None),
    ],
)
def test_each_format_prepares_as_its_messages_equivalent(tmp_path, chat, fmt, row, messages):
    messages = messages or [
        {"role": "user", "content": "reverse abc"},
        {"role": "assistant", "content": "cba"},
    ]
    given = _jsonl(tmp_path / "given.jsonl", [row, row])
    equivalent = _jsonl(tmp_path / "messages.jsonl", [{"messages": messages}] * 2)
    read = data_formats.read(given)
    assert (read.format, read.detected) == (fmt, True)
    assert _encoded(given) == _encoded(equivalent)
    assert _templated(given, chat) == _templated(equivalent, chat)
    declared = data_formats.read(given, data_formats.Source(fmt))
    assert (declared.format, declared.detected) == (fmt, False)


def test_prompt_response_is_one_user_and_one_assistant_turn_under_a_chat_template(tmp_path, chat):
    pairs = _jsonl(tmp_path / "p.jsonl", [{"prompt": Q1, "response": A1}])
    turns = [{"role": "user", "content": Q1}, {"role": "assistant", "content": A1}]
    equivalent = _jsonl(tmp_path / "m.jsonl", [{"messages": turns}])
    assert _templated(pairs, chat) == _templated(equivalent, chat)
    # without a template the pair keeps its layout (the demos' bytes): <bos> p <sep> r <eos>
    (encoded,) = _encoded(pairs)
    assert encoded.prompt == [tk.BOS_ID, *Q1.encode(), tk.SEP_ID]
    assert encoded.response == [*A1.encode(), tk.EOS_ID]


def test_a_text_row_is_trained_whole(tmp_path, chat):
    path = _jsonl(tmp_path / "t.jsonl", [{"text": "abc"}])
    assert _encoded(path)[0].tokens == [tk.BOS_ID, *b"abc", tk.EOS_ID]
    assert _encoded(path)[0].prompt == [tk.BOS_ID]  # the first token has nothing to predict it
    tokenizer, _ = chat
    (templated,) = _templated(path, chat)
    assert templated.tokens == [*tokenizer.encode("abc"), tokenizer.eos_id]  # no bos: none set
    assert templated.response_mask() == [1] * (len(templated.tokens) - 1)


def _parquet_both(tmp_path: Path, rows: list[dict]) -> list[Path]:
    import pandas as pd
    import pyarrow as pa
    import pyarrow.parquet as pq

    by_pandas = tmp_path / "pandas.parquet"
    pd.DataFrame(rows).to_parquet(by_pandas)
    by_pyarrow = tmp_path / "pyarrow.parquet"
    pq.write_table(pa.Table.from_pylist(rows), by_pyarrow)
    return [by_pandas, by_pyarrow]


TOOL_CALL = {"type": "function", "function": {"name": "rev", "arguments": '{"s": "abc"}'}}
WITH_TOOL = [
    {"role": "user", "content": Q1},
    {"role": "assistant", "tool_calls": [TOOL_CALL]},
    {"role": "tool", "content": "cba", "tool_call_id": "1"},
    {"role": "assistant", "content": A1},
]


@pytest.mark.parametrize(
    "rows",
    [
        [{"messages": MESSAGES}, {"messages": WITH_TOOL}],
        [{"conversations": SHAREGPT}],
        [ALPACA, {"instruction": "reverse abc", "input": "", "output": "cba"}],
        [{"prompt": Q1, "response": A1}],
        [{"text": "abc"}],
    ],
    ids=["messages", "sharegpt", "alpaca", "prompt_response", "text"],
)
def test_parquet_written_by_pandas_and_pyarrow_reads_as_the_jsonl(tmp_path, rows):
    jsonl = data_formats.read(_jsonl(tmp_path / "rows.jsonl", rows))
    for path in _parquet_both(tmp_path, rows):
        read = data_formats.read(path)
        assert read.format == jsonl.format
        assert [e.conversation() for e in read.examples] == [
            e.conversation() for e in jsonl.examples
        ]
        assert _encoded(path) == _encoded(tmp_path / "rows.jsonl")


def test_a_column_mapping_names_the_files_fields(tmp_path):
    source = data_formats.Source("messages", {"messages": "dialogue"})
    renamed = [{"dialogue": MESSAGES}]
    expected = _encoded(_jsonl(tmp_path / "m.jsonl", [{"messages": MESSAGES}]))
    assert _encoded(_jsonl(tmp_path / "r.jsonl", renamed), source) == expected
    for path in _parquet_both(tmp_path, renamed):
        assert _encoded(path, source) == expected
    roles = data_formats.Source(None, {}, {"bot": "assistant"})
    bot = [dict(t, **({"from": "bot"} if t["from"] == "gpt" else {})) for t in SHAREGPT]
    assert _encoded(_jsonl(tmp_path / "s.jsonl", [{"conversations": bot}]), roles) == expected


def _bad(tmp_path: Path, good: dict, bad: dict, source=None) -> str:
    path = _jsonl(tmp_path / "bad.jsonl", [good, bad])
    with pytest.raises(data_formats.DataError) as info:
        data_formats.read(path, source)
    return str(info.value).removeprefix(f"{path}:2: ")


def test_bad_conversations_name_the_line_and_field(tmp_path):
    good = {"messages": MESSAGES}
    empty = [MESSAGES[1], {"role": "assistant", "content": "  "}]
    assert _bad(tmp_path, good, {"messages": empty}).startswith("messages[1].content is empty")
    no_answer = [MESSAGES[0], MESSAGES[1]]
    assert "has no assistant turn" in _bad(tmp_path, good, {"messages": no_answer})
    unknown = [{"role": "robot", "content": "x"}, MESSAGES[2]]
    assert _bad(tmp_path, good, {"messages": unknown}).startswith("messages[0].role is 'robot'")
    odd = [{"from": "human", "value": Q1}, {"from": "bot", "value": A1}]
    message = _bad(tmp_path, {"conversations": SHAREGPT}, {"conversations": odd})
    assert message.startswith("conversations[1].from is 'bot', not in the role mapping")
    mixed = _bad(tmp_path, good, {"prompt": Q1, "response": A1})
    assert mixed.startswith("fields ['prompt', 'response'] are not those of 'messages'")
    assert mixed.endswith("a file holds one shape")


def test_a_parquet_file_with_the_wrong_columns_is_refused(tmp_path):
    for path in _parquet_both(tmp_path, [{"question": Q1, "answer": A1}]):
        with pytest.raises(data_formats.DataError, match=rf"^{path} \(row 0\): fields "):
            data_formats.read(path)
        declared = data_formats.Source("prompt_response")
        pattern = rf"^{path}: Parquet columns \['answer', 'question'\] are not those of format"
        with pytest.raises(data_formats.DataError, match=pattern):
            data_formats.read(path, declared)


def _inputs(root: Path, files: dict[str, tuple[str, bytes, dict]]) -> list[dict]:
    entries = []
    for split, (name, blob, settings) in files.items():
        (root / name).write_bytes(blob)
        sha = hashlib.sha256(blob).hexdigest()
        entries.append({"name": split, "path": name, "sha256": sha, **settings})
    return entries


def _lines(rows) -> bytes:
    return "".join(json.dumps(r) + "\n" for r in rows).encode()


def _recipe(root: Path, train_rows, **train_settings) -> dict:
    dev = _lines([{"messages": MESSAGES}] * 4)
    inputs = _inputs(
        root,
        {
            "train": ("train.jsonl", _lines(train_rows), train_settings),
            "dev": ("dev.jsonl", dev, {}),
            "test": ("test.jsonl", dev, {"format": "messages"}),
        },
    )
    pins = {e["name"]: e["sha256"] for e in inputs}
    sections = merged(TINY_SFT, training={"seq_len": 128})  # a whole conversation per row
    return {**packed_sft_recipe(pins, "formats", **sections), "inputs": inputs}


def test_the_prepared_manifest_records_each_inputs_format(tmp_path):
    rows = [{"conversations": SHAREGPT}] * 8
    raw = write_recipe(tmp_path / "raw.json", _recipe(tmp_path, rows))
    preparation.validate(raw, tmp_path / "recipe.json", tmp_path / "validation.json")
    manifest = preparation.prepare(tmp_path / "recipe.json", tmp_path, tmp_path / "examples")
    formats = manifest["meta"]["formats"]
    assert formats["train"] == {"format": "sharegpt", "detected": True, "examples": 8}
    assert formats["test"] == {"format": "messages", "detected": False, "examples": 4}
    # both answers of every conversation are trained: 2 × (3 letters + eos) per example
    assert manifest["meta"]["splits"]["train"]["loss_tokens"] == 8 * 2 * 4


def test_reading_settings_enter_the_digests_only_when_given(tmp_path):
    rows = [{"conversations": SHAREGPT}]
    plain = recipes.validate(_recipe(tmp_path, rows))
    declared = recipes.validate(_recipe(tmp_path, rows, format="sharegpt"))
    spelled = _recipe(tmp_path, rows)
    spelled["training"] = {**spelled["training"], "train_on": "all_assistant"}
    last = _recipe(tmp_path, rows)
    last["training"] = {**last["training"], "train_on": "last_assistant"}
    digests = [
        (r.computation_digest, r.examples_digest)
        for r in (plain, declared, recipes.validate(spelled), recipes.validate(last))
    ]
    assert digests[0] == digests[2]  # the absent value spelled out is the same computation
    assert len({digests[0], digests[1], digests[3]}) == 3
    assert len({d[1] for d in (digests[0], digests[1], digests[3])}) == 3


def test_a_bad_file_fails_prepare_naming_row_and_field_and_writes_nothing(tmp_path):
    odd = [{"from": "human", "value": Q1}, {"from": "bot", "value": A1}]
    raw = write_recipe(tmp_path / "raw.json", _recipe(tmp_path, [{"conversations": odd}]))
    preparation.validate(raw, tmp_path / "recipe.json", tmp_path / "validation.json")
    with pytest.raises(data_formats.DataError) as info:
        preparation.prepare(tmp_path / "recipe.json", tmp_path, tmp_path / "examples")
    assert str(info.value).startswith(f"{tmp_path / 'train.jsonl'}:1: conversations[1].from is")
    assert not (tmp_path / "examples").exists()


@pytest.mark.slow
def test_the_worker_exits_2_on_a_bad_conversation_and_trains_nothing(tmp_path):
    empty = [MESSAGES[1], {"role": "assistant", "content": ""}]
    path = write_recipe(tmp_path / "raw.json", _recipe(tmp_path, [{"messages": empty}]))
    proc = run_attempt(path, tmp_path, tmp_path / "out", codes=(2,))
    assert "Traceback" not in proc.stderr
    (attempt,) = [p for p in (tmp_path / "out" / "formats").iterdir() if p.is_dir()]
    result = json.loads((attempt / "result.json").read_text())
    assert result["error"]["phase"] == "examples"
    assert result["error"]["message"].startswith(
        f"{tmp_path / 'train.jsonl'}:1: messages[1].content is empty"
    )
    assert not [e for e in read_events(attempt / "events.jsonl") if e["type"] == "update"]


def test_everything_is_refused_for_a_conversation_with_a_tool_result(tmp_path):
    path = _jsonl(tmp_path / "tool.jsonl", [{"messages": MESSAGES}, {"messages": WITH_TOOL}])
    examples = data_formats.read(path).examples
    with pytest.raises(data_formats.DataError, match=rf"^{path}:2: .*tool's output"):
        encoding.encode_examples(examples, tk.byte_tokenizer(), "everything", path)
    # every assistant turn, the tool call's text included; the tool's output is context
    encoded = encoding.encode_examples(examples, tk.byte_tokenizer(), "all_assistant", path)[1]
    trained = bytes(
        t for t, f in zip(encoded.response, encoded.response_mask(), strict=True) if f and t < 256
    )
    assert trained == json.dumps([TOOL_CALL]).encode() + A1.encode()
