"""The chain's before/after record of a grpo recipe (minifield.pipeline.rl_before_after): the
figures of an HF directory against greedy decoding by the loaded model's own generate and the
exact-match by hand; the checks against hand-made records."""

from __future__ import annotations

import json

import pytest
from grpo_cases import make_inputs, recipe

from minifield import recipe as recipes
from minifield.hf import loaded_model
from minifield.pipeline import rl_before_after


@pytest.mark.slow
def test_figures_of_a_model_are_its_greedy_answers_scored_by_hand(tmp_path):
    root = make_inputs(tmp_path / "in")
    raw = recipe(root, evaluation={"max_dev_reward_drop": 0.0, "max_dev_exact_match_drop": 0.0})
    validated = recipes.validate(raw).data
    recipe_path = tmp_path / "recipe.json"
    recipe_path.write_text(json.dumps(validated))
    prompts = {s: root / "prompts" / f"{s}.jsonl" for s in ("dev", "test")}
    record = rl_before_after.compare(
        root / "base", root / "base", prompts, {}, recipe_path,
        tmp_path / "record.json", tmp_path / "table.html",
    )  # fmt: skip
    model = loaded_model.from_hf_directory(root / "base")
    rows = [json.loads(line) for line in prompts["dev"].read_text().splitlines()]
    budget = raw["rl"]["max_completion_length"]
    by_hand = [
        model.generate(row.get("prompt", row.get("messages")), budget, temperature=0.0).strip()
        == row["answer"]
        for row in rows
    ]
    dev = record["before"]["dev"]
    assert dev["exact_match"] == pytest.approx(sum(by_hand) / len(rows))
    assert dev["reward"] == dev["exact_match"]  # the one reward, weight 1
    assert record["after"] == record["before"] and record["dev_reward_change"] == 0
    assert [c["passed"] for c in record["checks"]] == [True, True]
    assert json.loads((tmp_path / "record.json").read_text()) == record
    assert "PASS" in (tmp_path / "table.html").read_text()


def _record(before: float, after: float) -> dict:
    split = {"reward": before, "exact_match": before, "pass_at_1": before}
    later = {"reward": after, "exact_match": after, "pass_at_1": after}
    return {"before": {"dev": split}, "after": {"dev": later}}


def test_a_drop_beyond_the_tolerance_fails_naming_both_numbers(tmp_path):
    evaluation = {"max_dev_reward_drop": 0.05}
    record = _record(0.60, 0.54)
    record["checks"] = rl_before_after.checks(record, evaluation)
    assert [c["passed"] for c in record["checks"]] == [False]
    message = rl_before_after.refusal(record, tmp_path / "r.json")
    assert "reward after 0.5400 < before 0.6000 - 0.05" in message
    record = _record(0.60, 0.55)
    record["checks"] = rl_before_after.checks(record, evaluation)
    assert rl_before_after.refusal(record, tmp_path / "r.json") is None
    assert rl_before_after.checks(record, {}) == []  # no tolerance: shown, not checked
