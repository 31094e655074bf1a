"""Text the tokenizer cannot spell (docs/own-data.md, ``training.allow_unknown_tokens``): a
newcomer's rows with capitals, digits and punctuation through the real tokenizer of the shipped
base (``data/llama-base``: a-z, space and colon). ``<unk>`` never ends an assistant turn; such
rows are refused before training with one line naming file:line, the characters and the rows
(``prepare``, ``minifield validate``, ``minifield recipe new``), or trained as ``<unk>`` and
counted where the recipe allows it.

What the tokenizer can spell is read here from its ``tokenizer.json`` vocabulary, not from
minifield: a character outside it is unknown.
"""

from __future__ import annotations

import copy
import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml
from conftest import REPO

from minifield import cli
from minifield import recipe as recipes
from minifield.data.formats import DataError
from minifield.inputs import pinned

LIKE = REPO / "config" / "recipes" / "llama-sft-demo.yaml"
BASE = REPO / "data" / "llama-base"
BASE_FILES = {
    "base-config": "config.json",
    "base-weights": "model.safetensors",
    "base-tokenizer": "tokenizer.json",
    "base-tokenizer-config": "tokenizer_config.json",
}
#: (prompt, answer): the first spells, the others hold a capital, a digit, punctuation
ROWS = [
    ("copy: abc", "abc"),
    ("what is raised", "Exceptions"),
    ("say it", "ab Cd ef"),
    ("count", "one, 2 three."),
]
VOCAB = json.loads((BASE / "tokenizer.json").read_text())["model"]["vocab"]
UNK, EOS = VOCAB["<unk>"], VOCAB["<eos>"]


def unknown(text: str) -> list[str]:
    return [c for c in text if c not in VOCAB]


def chat_line(prompt: str, answer: str) -> str:
    messages = [{"role": "user", "content": prompt}, {"role": "assistant", "content": answer}]
    return json.dumps({"messages": messages}) + "\n"


@pytest.fixture
def root(tmp_path) -> Path:
    """An input root: the shipped base's files and ``mine/{train,dev}.jsonl``; the train file
    opens with a blank line, so a row's line is not its index."""
    root = tmp_path / "data"
    (root / "base").mkdir(parents=True)
    for name in BASE_FILES.values():
        shutil.copy(BASE / name, root / "base" / name)
    (root / "mine").mkdir()
    (root / "mine" / "train.jsonl").write_text("\n" + "".join(chat_line(*r) for r in ROWS))
    (root / "mine" / "dev.jsonl").write_text(chat_line("copy: xyz", "xyz"))
    return root


def recipe(root: Path, **training) -> dict:
    """The Llama demo recipe on ``root``'s files, each pinned by ``hashlib``."""
    document = copy.deepcopy(yaml.safe_load(LIKE.read_text()))
    paths = {"train": "mine/train.jsonl", "dev": "mine/dev.jsonl", "test": "mine/dev.jsonl"}
    paths.update({name: f"base/{file}" for name, file in BASE_FILES.items()})
    document["inputs"] = [
        {"name": n, "path": p, "sha256": hashlib.sha256((root / p).read_bytes()).hexdigest()}
        for n, p in paths.items()
    ]
    document["training"].update(training)
    return document


def files(root: Path, document: dict) -> dict[str, Path]:
    return pinned.files_by_name(document, root)


def test_the_base_tokenizer_cannot_spell_capitals_digits_or_punctuation():
    # the premise of every test below, from the vocabulary itself
    assert [unknown(a) for _, a in ROWS] == [[], ["E"], ["C"], [",", "2", "."]]
    assert set("abcdefghijklmnopqrstuvwxyz :") <= set(VOCAB)


def test_unk_ends_no_trained_turn_but_still_stops_a_grpo_completion():
    from minifield.data import assistant_turns
    from minifield.data import tokenizer as tokenizers
    from minifield.strategies.grpo.evaluator import stop_ids

    tokenizer = tokenizers.from_file(BASE / "tokenizer.json")
    added = json.loads((BASE / "tokenizer.json").read_text())["added_tokens"]
    specials = {t["id"] for t in added if t["special"]}
    assert UNK in specials
    backend = tokenizer.backend
    assert assistant_turns.end_of_turn_ids(backend, EOS) == specials - {UNK}
    # a rollout that writes <unk> stops there, as before: its reward never sees the text
    # without what the tokenizer could not spell
    assert stop_ids(tokenizer) == tuple(sorted(specials))


def test_prepare_refuses_naming_the_first_rows_line_the_characters_and_the_rows(root):
    checked = recipes.validate(recipe(root))
    with pytest.raises(DataError) as caught:
        checked.strategy.unknown_tokens(checked.data, files(root, checked.data))
    message = str(caught.value)
    assert "\n" not in message
    # line 3: the blank line 1, then the row that spells, then "Exceptions"
    assert message.startswith(f"{root / 'mine' / 'train.jsonl'}:3: 3 of 4 rows ")
    assert "',', '.', '2', 'C', 'E'" in message
    assert str(root / "base" / "tokenizer.json") in message
    assert "training.allow_unknown_tokens: true" in message
    # the prepare stage itself refuses before any training
    with pytest.raises(DataError, match=r"train\.jsonl:3: 3 of 4 rows"):
        checked.strategy.prepare(checked.data, files(root, checked.data))


def test_allowed_unknown_text_is_trained_as_unk_to_the_end_of_the_turn_and_counted(root):
    checked = recipes.validate(recipe(root, allow_unknown_tokens=True))
    arrays, meta = checked.strategy.prepare(checked.data, files(root, checked.data))
    counted = [c for _, a in ROWS for c in unknown(a)]
    assert meta["formats"]["train"]["unknown_tokens"] == {
        "rows": 3,
        "tokens": len(counted),
        "characters": sorted(set(counted)),
    }
    assert meta["formats"]["dev"]["unknown_tokens"] == {"rows": 0, "tokens": 0, "characters": []}
    # every answer trained whole, <unk> where a character is unknown, then its end of turn:
    # "Exceptions" is not empty, "ab Cd ef" is not cut after "ab "
    trained = []
    tokens, segments, mask = (arrays[f"train_{k}"] for k in ("tokens", "segments", "loss_mask"))
    for row in range(tokens.shape[0]):
        for segment in set(segments[row].tolist()) - {0}:
            picked = (segments[row] == segment) & (mask[row] > 0)
            trained.append(tokens[row][picked].tolist())
    expected = [[VOCAB.get(c, UNK) for c in answer] + [EOS] for _, answer in ROWS]
    assert sorted(trained) == sorted(expected)
    assert int(np.count_nonzero(tokens == UNK)) == len(counted)


def test_the_key_is_in_both_digests_only_when_true(root):
    absent = recipes.validate(recipe(root))
    false = recipes.validate(recipe(root, allow_unknown_tokens=False))
    true = recipes.validate(recipe(root, allow_unknown_tokens=True))
    assert "allow_unknown_tokens" not in false.data["training"]
    assert (false.computation_digest, false.examples_digest) == (
        absent.computation_digest,
        absent.examples_digest,
    )
    assert true.computation_digest != absent.computation_digest
    assert true.examples_digest != absent.examples_digest


def test_strategies_that_do_not_read_the_key_refuse_it():
    document = yaml.safe_load((REPO / "config" / "recipes" / "grpo-demo.yaml").read_text())
    document["training"]["allow_unknown_tokens"] = True
    with pytest.raises(recipes.RecipeError, match="/training/allow_unknown_tokens: not read"):
        recipes.validate(document)
    document = yaml.safe_load((REPO / "config" / "recipes" / "two-stage-pretrain.yaml").read_text())
    document["training"]["allow_unknown_tokens"] = True
    with pytest.raises(recipes.RecipeError, match="/training/allow_unknown_tokens: not read"):
        recipes.validate(document)


def test_validate_refuses_with_exit_2_and_counts_where_allowed(root, tmp_path, capsys):
    refused, allowed = tmp_path / "refused.yaml", tmp_path / "allowed.yaml"
    refused.write_text(yaml.safe_dump(recipe(root)))
    allowed.write_text(yaml.safe_dump(recipe(root, allow_unknown_tokens=True)))
    assert cli.main(["validate", str(refused)]) == 0  # without the files: nothing to read
    capsys.readouterr()
    assert cli.main(["validate", str(refused), "--input-root", str(root)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1
    assert err.startswith(f"minifield validate: {root / 'mine' / 'train.jsonl'}:3: 3 of 4 rows")
    assert cli.main(["validate", str(allowed), "--input-root", str(root)]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["unknown_tokens"]["train"]["rows"] == 3


def test_recipe_new_writes_the_recipe_and_warns_what_prepare_will_refuse(root, tmp_path, capsys):
    output = tmp_path / "mine.yaml"
    argv = ["recipe", "new", "--like", str(LIKE), "--base", str(root / "base")]
    argv += ["--train", str(root / "mine" / "train.jsonl")]
    argv += ["--dev", str(root / "mine" / "dev.jsonl"), "--input-root", str(root)]
    assert cli.main([*argv, "-o", str(output)]) == 0
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert err.startswith(
        f"minifield recipe new: warning: {root / 'mine' / 'train.jsonl'}:3: 3 of 4 rows"
    )
    assert "',', '.', '2', 'C', 'E'" in err and "recipe repin" in err
    assert output.is_file()


@pytest.mark.slow  # starts the installed `minifield`
def test_validate_refusal_is_one_line_and_exit_2_from_the_installed_command(root, tmp_path):
    refused = tmp_path / "refused.yaml"
    refused.write_text(yaml.safe_dump(recipe(root)))
    proc = subprocess.run(
        [str(Path(sys.executable).parent / "minifield"), "validate", str(refused)]
        + ["--input-root", str(root)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr
    assert "train.jsonl:3: 3 of 4 rows" in proc.stderr and "'C', 'E'" in proc.stderr
