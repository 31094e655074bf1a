"""Supervised JSONL reading (both forms, errors with file:line) and the demo dataset."""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import subprocess
import sys

import pytest
import yaml

from minifield.commands import make_demo_data
from minifield.data import encoding
from minifield.data import tokenizer as tk
from minifield.strategies.packed_sft import demo_data


def _write(path, lines):
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


def test_reads_prompt_response_and_chat_rows(tmp_path):
    chat = {
        "messages": [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "hello"},
        ]
    }
    pairs = _write(tmp_path / "p.jsonl", [json.dumps({"prompt": "ab", "response": "ba"}), ""])
    chats = _write(tmp_path / "c.jsonl", ["", json.dumps(chat)])
    assert encoding.read_jsonl(pairs) == [encoding.Example("ab", "ba")]
    assert encoding.read_jsonl(chats) == [encoding.Example("system: be brief\nuser: hi\n", "hello")]


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        ("{not json", "not valid JSON"),
        (json.dumps([1, 2]), "expected a JSON object, got list"),
        (json.dumps({"prompt": "a"}), r"fields \['prompt'\] are not those of 'prompt_response'"),
        (json.dumps({"prompt": "a", "response": 3}), "'response' must be a string"),
        (json.dumps({"prompt": "a", "response": ""}), "'response' is empty"),
        (json.dumps({"messages": [{"role": "user", "content": "x"}]}), "at least two messages"),
        (
            json.dumps(
                {"messages": [{"role": "user", "content": "x"}, {"role": "bot", "content": "y"}]}
            ),
            r"messages\[1\]\.role is 'bot', not one of",
        ),
        (
            json.dumps(
                {
                    "messages": [
                        {"role": "assistant", "content": "x"},
                        {"role": "user", "content": "y"},
                    ]
                }
            ),
            "the last message is from 'user'",
        ),
    ],
)
def test_bad_row_is_reported_with_file_and_line(tmp_path, bad, message):
    good = json.dumps({"prompt": "a", "response": "b"})
    if '"messages"' in bad:  # a file holds one shape: the good rows are conversations too
        turns = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
        good = json.dumps({"messages": turns})
    path = _write(tmp_path / "bad.jsonl", [good, "", bad, good])
    with pytest.raises(encoding.DataError, match=message) as info:
        encoding.read_jsonl(path)
    assert str(info.value).startswith(f"{path}:3: ")  # line 3, counting the blank line


def test_empty_file_is_an_error(tmp_path):
    path = _write(tmp_path / "empty.jsonl", [""])
    with pytest.raises(encoding.DataError, match="no examples"):
        encoding.read_jsonl(path)


def test_encode_layout_is_bos_prompt_sep_response_eos():
    tok = tk.byte_tokenizer()
    encoded = encoding.encode(encoding.Example("ab", "c"), tok)
    assert encoded.prompt == [257, ord("a"), ord("b"), 259]
    assert encoded.response == [ord("c"), 258]
    assert len(encoded) == 6


def test_demo_generator_is_deterministic_checkable_and_disjoint():
    splits = demo_data.demo_examples()
    assert {k: len(v) for k, v in splits.items()} == {"train": 4000, "dev": 200, "test": 200}
    words = [e.prompt for rows in splits.values() for e in rows]
    assert len(words) == len(set(words))  # no string occurs twice, across splits too
    for rows in splits.values():
        for e in rows:
            assert 3 <= len(e.prompt) <= 6 and e.prompt.isalpha() and e.response == e.prompt[::-1]


@pytest.mark.slow
def test_shipped_demo_files_are_what_make_demo_data_writes_and_the_recipe_pins(tmp_path, repo):
    out = tmp_path / "demo"
    proc = subprocess.run(
        [sys.executable, "-m", "minifield.cli", "make-demo-data", str(out)],
        capture_output=True,
        text=True,
        check=True,
    )
    printed = json.loads(proc.stdout)
    recipe = yaml.safe_load((repo / "config/recipes/sft-demo.yaml").read_text())
    pins = {i["name"]: (i["path"], i["sha256"]) for i in recipe["inputs"]}
    for split in ("train", "dev", "test"):
        written = (out / f"{split}.jsonl").read_bytes()
        shipped = (repo / "data" / pins[split][0]).read_bytes()
        assert written == shipped
        assert hashlib.sha256(shipped).hexdigest() == pins[split][1] == printed[split]["sha256"]


@pytest.mark.parametrize(
    ("flag", "sources", "written"),
    [
        ("two_stage", ("two-stage/corpus",), ("two-stage/sft",)),
        ("preference", ("llama-sft-demo",), ("preference-demo",)),
        ("grpo", ("llama-sft-demo",), ("grpo-demo", "grpo-learn")),
    ],
)
def test_derived_demo_data_is_the_shipped_data(tmp_path, repo, capsys, flag, sources, written):
    # two-stage's files sit under DIR/corpus and DIR/sft, the others' under their own names
    def under_root(name):
        return tmp_path / name.removeprefix("two-stage/")

    for name in sources:
        shutil.copytree(repo / "data" / name, under_root(name))
    args = argparse.Namespace(
        directory=tmp_path, two_stage=False, preference=False, grpo=False, llama=False
    )
    setattr(args, flag, True)
    assert make_demo_data.run(args) == 0
    printed = json.dumps(json.loads(capsys.readouterr().out))
    for name in written:
        for shipped in sorted((repo / "data" / name).glob("*.jsonl")):
            copy = under_root(name) / shipped.name
            assert copy.read_bytes() == shipped.read_bytes()
            assert hashlib.sha256(shipped.read_bytes()).hexdigest() in printed


def test_derived_demo_data_without_its_sources_is_one_line_and_exit_2(tmp_path, capsys):
    args = argparse.Namespace(
        directory=tmp_path, two_stage=False, preference=True, grpo=False, llama=False
    )
    assert make_demo_data.run(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("minifield make-demo-data: ") and err.count("\n") == 1
    assert "llama-sft-demo" in err
