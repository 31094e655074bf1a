"""grpo recipes: one spelling per computation, and every bad recipe or input refused with exit
2 naming the field (validation) or the file, the row and the field (prepare); a Python reward
that fails ends the attempt (exit 1) naming the function and the update, never a silent 0."""

from __future__ import annotations

import json

import pytest
from conftest import attempts_of, run_attempt, run_worker, write_recipe
from grpo_cases import make_inputs, pin, recipe

import minifield
from minifield import recipe as recipes


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return make_inputs(tmp_path_factory.mktemp("grpo") / "in")


def _errors(raw) -> dict[str, str]:
    checked = minifield.validate(raw)
    assert not checked.valid
    return {e["path"]: e["message"] for e in checked.errors}


def test_absent_keys_and_their_defaults_spelled_out_are_one_computation(root):
    plain = minifield.validate(recipe(root))
    assert plain.valid, plain.errors
    spelled = recipe(
        root,
        {
            "temperature": 1,
            "top_p": 1,
            "top_k": 0,
            "loss_type": "dapo",
            "scale_rewards": "group",
            "beta": 0,
            "epsilon": 0.2,
            "epsilon_high": 0.2,
            "num_iterations": 1,
            "importance_sampling_level": "token",
            "mask_truncated_completions": False,
            "rewards": [{"kind": "exact_match", "column": "answer", "weight": 1}],
        },
    )
    assert minifield.validate(spelled).computation_digest == plain.computation_digest
    other = minifield.validate(recipe(root, {"epsilon_high": 0.28}))
    assert other.computation_digest != plain.computation_digest


@pytest.mark.parametrize(
    ("change", "path", "words"),
    [
        ({"rl": {"num_generations": 1}}, "/rl/num_generations", "minimum"),
        ({"training": {"batch_size": 6}}, "/training/batch_size", "multiple of"),
        ({"rl": {"loss_type": "ppo"}}, "/rl/loss_type", "ppo"),
        ({"rl": {"rewards": [{"kind": "bogus"}]}}, "/rl/rewards/0", "bogus"),
        ({"rl": {"max_completion_length": 48}}, "/rl/max_completion_length", "seq_len"),
        ({"training": {"train_on": "everything"}}, "/training/train_on", "not read"),
        ({"training": {"grad_accum_steps": 3}}, "/training/grad_accum_steps", "multiple of"),
        ({"training": {"data_parallel": {"devices": 3}}}, "/training/data_parallel", "divide"),
        (
            {"rl": {"rewards": [{"kind": "python", "file": "rewards-py", "function": "f"}]}},
            "/rl/rewards/0/file",
            "rewards-py",
        ),
        ({"rl": {"rewards": [{"kind": "regex", "pattern": "(["}]}}, "/rl/rewards/0/pattern", ""),
        ({"preference": {"loss": "dpo"}}, "/preference", "only for a strategy"),
    ],
)
def test_bad_recipes_are_refused_naming_the_field(root, change, path, words):
    raw = recipe(root)
    for section, values in change.items():
        raw[section] = {**raw.get(section, {}), **values}
    errors = _errors(raw)
    found = [p for p in errors if p.startswith(path)]
    assert found, errors
    assert words in errors[found[0]], errors


def test_a_recipe_without_the_rl_section_gets_that_one_error(root):
    """Every other check reads ``rl``, so its absence is the only thing said."""
    raw = recipe(root)
    del raw["rl"]
    assert _errors(raw) == {"/rl": "the grpo strategy needs it (rl.rewards at least)"}


@pytest.mark.slow
def test_the_worker_refuses_bad_recipes_and_inputs_with_exit_2_and_one_line(tmp_path, root):
    bad = write_recipe(tmp_path / "g.json", recipe(root, {"num_generations": 3}))
    verdict = run_worker("--job", bad, "--validate-only")
    assert verdict.returncode == 2 and "/training/batch_size" in verdict.stdout
    run = run_worker("--job", bad, "--input-root", root, "--output-root", tmp_path / "o")
    assert run.returncode == 2 and "Traceback" not in run.stderr
    assert not (tmp_path / "o").exists()
    # a prompt row without the column a reward reads: the file, its line and the column
    data = make_inputs(tmp_path / "in2")
    dev = data / "prompts" / "dev.jsonl"
    rows = dev.read_text().splitlines()
    rows[2] = json.dumps({k: v for k, v in json.loads(rows[2]).items() if k != "answer"})
    dev.write_text("\n".join(rows) + "\n")
    missing = write_recipe(tmp_path / "m.json", recipe(data))
    run = run_attempt(missing, data, tmp_path / "o2", codes=(2,))
    assert f"{dev}:3: missing column 'answer'" in run.stderr and "Traceback" not in run.stderr
    # prompts longer than seq_len minus max_completion_length
    short = write_recipe(tmp_path / "s.json", recipe(root, training={"seq_len": 20}))
    run = run_attempt(short, root, tmp_path / "o3", codes=(2,))
    assert (
        "rl.max_completion_length leaves 8" in run.stderr and "prompts/train.jsonl:1" in run.stderr
    )


REWARD_FILE = """
def reversed_letters(prompts, completions, completion_ids, answer, **kwargs):
    return [float(c.strip() == a) + 0.25 * (len(ids) <= 8) for c, ids, a in zip(completions, completion_ids, answer)]

def broken(prompts, completions, **kwargs):
    raise ValueError("no score for you")
"""


@pytest.mark.slow
def test_a_pinned_python_reward_scores_and_its_failure_ends_the_attempt(tmp_path):
    root = make_inputs(tmp_path / "in")
    (root / "reward.py").write_text(REWARD_FILE)
    raw = recipe(
        root, {"rewards": [{"kind": "python", "file": "reward", "function": "reversed_letters"}]}
    )
    raw["inputs"].append(pin(root, "reward", "reward.py"))
    raw["limits"]["max_steps"] = 2
    # the worker's temporary files go here: nothing of them may outlive it
    temporary = tmp_path / "tmp"
    temporary.mkdir()
    env = {"TMPDIR": str(temporary)}
    run_attempt(write_recipe(tmp_path / "ok.json", raw), root, tmp_path / "ok", env=env)
    assert list(temporary.iterdir()) == []
    (attempt,) = attempts_of(tmp_path / "ok", "grpo-test")
    answers = [
        json.loads(line)["answer"]
        for line in (root / "prompts" / "train.jsonl").read_text().splitlines()
    ]
    for line in (attempt / "rollouts" / "update-00000001.jsonl").read_text().splitlines():
        row = json.loads(line)
        by_hand = float(row["completion"].strip() == answers[row["prompt_index"]])
        by_hand += 0.25 * (len(row["completion_ids"]) <= 8)
        assert row["rewards"]["python"] == by_hand
    # the export carries the reward file, so the gate re-evaluates from it alone, and writes
    # nothing into it (a published copy must keep exactly the files its manifest lists)
    export = attempt / "export"
    assert (export / "reward-reward").read_text() == REWARD_FILE
    files = sorted(path.name for path in export.iterdir())
    loaded = recipes.load(tmp_path / "ok.json")
    gate = loaded.strategy.evaluate_export(loaded.data, export)
    assert sorted(path.name for path in export.iterdir()) == files
    assert 0.0 <= gate["dev_reward"] <= 1.25  # exact match 0 or 1, plus 0.25 when short
    raw["rl"]["rewards"][0]["function"] = "broken"
    bad = write_recipe(tmp_path / "bad.json", raw)
    run = run_attempt(bad, root, tmp_path / "bad", codes=(1,), env=env)
    assert list(temporary.iterdir()) == []
    assert "broken" in run.stderr and "no score for you" in run.stderr
    assert "update 1" in run.stderr and "Traceback" not in run.stderr
    (failed,) = attempts_of(tmp_path / "bad", "grpo-test")
    assert json.loads((failed / "result.json").read_text())["status"] == "failed"


def test_parquet_prompts_prepare_as_their_jsonl(tmp_path, root):
    import pandas as pd

    from minifield.strategies.grpo import prompts

    rows = [json.loads(line) for line in (root / "prompts" / "dev.jsonl").read_text().splitlines()]
    parquet = tmp_path / "dev.parquet"
    pd.DataFrame(
        {
            "prompt": [r.get("prompt") or r["messages"][0]["content"] for r in rows],
            "answer": [r["answer"] for r in rows],
        }
    ).to_parquet(parquet)
    from_parquet = prompts.read(parquet, ["answer"])
    from_jsonl = prompts.read(root / "prompts" / "dev.jsonl", ["answer"])
    # a messages row of one user turn is that turn's text as a prompt string
    assert [r.messages for r in from_parquet] == [r.messages for r in from_jsonl]
    assert [r.columns for r in from_parquet] == [{"answer": r["answer"]} for r in rows]
