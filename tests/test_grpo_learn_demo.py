"""The grpo-learn demo (docs/grpo-demo.md "From a weak start") as shipped: its prompts, its two
recipes and its chain. Fast tier only: the training run itself is measured and documented
(benchmarks/grpo_learn_seeds.py), not run in the suite; the chain mechanism and the
before/after check it goes through are the grpo demo's, run by tests/test_grpo_demo_pipeline.py.
"""

from __future__ import annotations

import hashlib
import json

import yaml
from conftest import REPO

import minifield
from minifield.strategies.grpo import demo_data

RECIPES = REPO / "config" / "recipes"
SPLITS = ("train", "dev", "test")


def _yaml(path):
    return yaml.safe_load(path.read_text())


def _pins(recipe: dict) -> dict[str, str]:
    return {item["path"]: item["sha256"] for item in recipe["inputs"]}


def test_the_prompts_regenerate_byte_for_byte_and_the_recipe_pins_them(tmp_path):
    for split in SPLITS:
        source = REPO / "data" / "llama-sft-demo" / f"{split}.jsonl"
        (tmp_path / "llama-sft-demo").mkdir(exist_ok=True)
        (tmp_path / "llama-sft-demo" / source.name).write_bytes(source.read_bytes())
    written = demo_data.write(tmp_path)
    pinned = {
        **_pins(_yaml(RECIPES / "grpo-demo.yaml")),
        **_pins(_yaml(RECIPES / "grpo-learn.yaml")),
    }
    for directory in ("grpo-demo", "grpo-learn"):
        for split in SPLITS:
            relative = f"{directory}/{split}.jsonl"
            shipped = (REPO / "data" / relative).read_bytes()
            assert (tmp_path / relative).read_bytes() == shipped, relative
            assert written[relative] == pinned[relative] == hashlib.sha256(shipped).hexdigest()


def test_the_prompts_are_the_mirror_tasks_strings_of_4_to_6_letters():
    words = {}
    for split in SPLITS:
        sft = (REPO / "data" / "llama-sft-demo" / f"{split}.jsonl").read_text().splitlines()
        expected = [json.loads(line)["prompt"] for line in sft]
        expected = [p for p in expected if len(p.removeprefix("mirror: ")) in (4, 5, 6)]
        rows = [json.loads(line) for line in (REPO / "data" / "grpo-learn" / f"{split}.jsonl")
                .read_text().splitlines()]  # fmt: skip
        assert [row["prompt"] for row in rows] == expected  # every such row, in the SFT's order
        for row in rows:
            assert set(row) == {"prompt", "answer"}
            word = row["prompt"].removeprefix("mirror: ")
            assert row["answer"] == word + "".join(reversed(word))
        words[split] = {row["prompt"] for row in rows}
    assert len(words["train"]) > 900 and len(words["dev"]) > 80 and len(words["test"]) > 80
    assert not (words["dev"] | words["test"]) & words["train"]


def test_the_weak_sft_is_the_sft_demo_but_for_its_learning_rate_and_gate():
    demo, weak = _yaml(RECIPES / "llama-sft-demo.yaml"), _yaml(RECIPES / "llama-sft-weak.yaml")
    assert weak["training"]["learning_rate"] < demo["training"]["learning_rate"]
    for recipe in (demo, weak):
        for key in ("job_id", "product"):
            del recipe[key]
        del recipe["training"]["learning_rate"]
        del recipe["evaluation"]["min_dev_exact_match"]
    assert weak == demo  # the same data, base, steps and schedule
    assert minifield.validate(RECIPES / "llama-sft-weak.yaml").valid


def test_grpo_learn_is_the_grpo_demo_on_its_prompts_chained_after_the_weak_sft():
    config = _yaml(REPO / "config" / "grpo-learn.yaml")
    weak, learn = "config/recipes/llama-sft-weak.yaml", "config/recipes/grpo-learn.yaml"
    assert config == {"recipes": [weak], "chains": [{"from": weak, "to": learn}]}
    demo, recipe = _yaml(RECIPES / "grpo-demo.yaml"), _yaml(RECIPES / "grpo-learn.yaml")
    assert recipe["evaluation"]["min_dev_reward"] >= 0.7  # the gate is the demo's claim
    assert "max_dev_reward_drop" in recipe["evaluation"]  # the chain's before/after check
    for item in recipe["inputs"]:
        if item["name"] in SPLITS:
            item.update(path=item["path"].replace("grpo-learn/", "grpo-demo/"), sha256=None)
    for one in (demo, recipe):
        for key in ("job_id", "product"):
            del one[key]
        del one["evaluation"]["min_dev_reward"]
        for item in one["inputs"]:
            if item["name"] in SPLITS:
                item["sha256"] = None
    assert recipe == demo  # the grpo demo's settings and base pins as they are
    assert minifield.validate(RECIPES / "grpo-learn.yaml").valid
