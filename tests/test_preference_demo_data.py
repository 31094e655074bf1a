"""The preference demo's pairs (data/preference-demo): they regenerate byte for byte from the
shipped mirror task, and each pair is checked by hand: chosen is the mirror of the prompt's
word, rejected one edit away from it (every one-letter change, drop and adjacent swap of the
chosen answer enumerated here by brute force)."""

from __future__ import annotations

import hashlib
import json
import string

import yaml
from conftest import REPO

from minifield.strategies.preference import demo_data

DATA = REPO / "data" / "preference-demo"
RECIPE = REPO / "config" / "recipes" / "preference-demo.yaml"


def one_edit_away(answer: str) -> dict[str, set[str]]:
    letters = string.ascii_lowercase
    return {
        "change": {
            answer[:i] + c + answer[i + 1 :]
            for i in range(len(answer))
            for c in letters
            if c != answer[i]
        },
        "drop": {answer[:i] + answer[i + 1 :] for i in range(len(answer))},
        "swap": {
            answer[:i] + answer[i + 1] + answer[i] + answer[i + 2 :]
            for i in range(len(answer) - 1)
            if answer[i] != answer[i + 1]
        },
    }


def rows(split: str) -> list[dict]:
    return [json.loads(line) for line in (DATA / f"{split}.jsonl").read_text().splitlines()]


def test_the_pairs_regenerate_byte_for_byte_and_the_recipe_pins_them(tmp_path):
    for split in ("train", "dev", "test"):
        source = REPO / "data" / "llama-sft-demo" / f"{split}.jsonl"
        (tmp_path / "llama-sft-demo").mkdir(exist_ok=True)
        (tmp_path / "llama-sft-demo" / source.name).write_bytes(source.read_bytes())
    pins = demo_data.write(tmp_path)
    recipe = yaml.safe_load(RECIPE.read_text())
    pinned = {item["path"]: item["sha256"] for item in recipe["inputs"]}
    for split in ("train", "dev", "test"):
        relative = f"preference-demo/{split}.jsonl"
        shipped = (REPO / "data" / relative).read_bytes()
        assert (tmp_path / relative).read_bytes() == shipped
        assert pins[relative] == pinned[relative] == hashlib.sha256(shipped).hexdigest()


def test_chosen_is_the_mirror_and_rejected_a_near_miss():
    kinds = {"change": 0, "drop": 0, "swap": 0}
    for split, count in (("train", 300), ("dev", 100), ("test", 100)):
        pairs = rows(split)
        sft = [
            json.loads(line)
            for line in (REPO / "data" / "llama-sft-demo" / f"{split}.jsonl")
            .read_text()
            .splitlines()
        ]
        assert len(pairs) == count
        # the same prompts as the SFT demo's split, in its order
        assert [p["prompt"] for p in pairs] == [r["prompt"] for r in sft[:count]]
        for pair in pairs:
            assert set(pair) == {"prompt", "chosen", "rejected"}
            word = pair["prompt"].removeprefix("mirror: ")
            assert pair["chosen"] == word + word[::-1]
            edits = one_edit_away(pair["chosen"])
            found = [kind for kind, made in edits.items() if pair["rejected"] in made]
            assert found, pair
            kinds[found[0]] += 1
    assert all(n > 50 for n in kinds.values()), kinds  # every kind of near miss is there
