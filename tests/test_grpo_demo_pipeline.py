"""The grpo demo through real Snakemake (docs/grpo-demo.md): the Llama SFT demo as shipped, then
grpo chained after its export as shipped (config/grpo.yaml, its two recipes, the demo's data),
in a copy of the README's run (``readme_pipeline_run``: the README's first command, which
trained the SFT demo, then `snakemake --configfile config/grpo.yaml` as docs/grpo-demo.md
says): the SFT demo is not trained again, the grpo computation and its recovery proof (both
modes, as shipped) run.

The demo learns by reward: DEV mean reward (greedy, the exact_match reward) rises from the SFT
export (before) to the grpo export (after) and reaches the recipe's gate
(``evaluation.min_dev_reward``), and the policy's sampled success on its training prompts (the
mean reward of its rollouts, temperature 1) is higher in the last updates than in the first.
Every figure is read from the pipeline's outputs: before and after from the chain's
``rl_before_after`` record (after: the grpo computation's own evaluation of its final
checkpoint, the export's state, too; before checked by hand, the SFT export's greedy answers
compared with the answers), the rollout rewards from the attempt's rollouts files (checked
against its ``update`` events). The SFT stage is not shortened: the grpo recipe is tuned on its
real export, which it has to improve on."""

import json
import re
from pathlib import Path

import numpy as np
import pytest
from conftest import PRODUCTION, copy_run, in_a_started_process, run_snakemake

from minifield.pipeline import reference_logprobs

# runs Snakemake; a demo as users run it, compiled as production does (conftest)
pytestmark = [pytest.mark.slow, pytest.mark.production_compile]

PARTS = ("llama-base", "llama-sft-demo", "grpo-demo")
RECIPES = ("llama-sft-demo", "grpo-demo")
#: updates at each end of the run whose rollouts are compared
ENDS = 20
#: whether the export's greedy answer to each DEV prompt is its answer (argv: the export, the
#: prompts file, the completion budget)
GREEDY_RIGHT = """
import json, sys
from minifield.hf import loaded_model
model = loaded_model.from_hf_directory(sys.argv[1])
rows = [json.loads(line) for line in open(sys.argv[2])]
budget = int(sys.argv[3])
print(json.dumps([
    model.generate(r["prompt"], budget, temperature=0.0).strip() == r["answer"] for r in rows
]))
"""


def make_project(readme_run: Path, tmp_path: Path) -> Path:
    """The README's run (its default pipeline, the Llama SFT demo included), copied: the grpo
    demo as a user runs it after the README's first command."""
    project = copy_run(readme_run, tmp_path / "project")
    for part in PARTS:  # the demo's files, as shipped
        assert (project / "data" / part).is_dir(), part
    for name in RECIPES:
        assert (project / "config" / "recipes" / f"{name}.yaml").is_file(), name
    return project


def rollout_rewards(attempt: Path) -> dict[int, float]:
    """Update -> the mean total reward of its rollouts file."""
    out = {}
    for path in sorted((attempt / "rollouts").glob("update-*.jsonl")):
        lines = [json.loads(line) for line in path.read_text().splitlines()]
        (update,) = {line["update"] for line in lines}
        out[update] = float(np.mean([line["total"] for line in lines]))
    return out


def test_grpo_chained_after_sft_raises_the_dev_reward(readme_pipeline_run, tmp_path):
    project = make_project(readme_pipeline_run, tmp_path)
    configfile = ("--configfile", "config/grpo.yaml")
    recipes = project / "config" / "recipes"
    a = reference_logprobs.validated(recipes / "llama-sft-demo.yaml").computation_digest[:16]
    b = reference_logprobs.validated(recipes / "grpo-demo.yaml").computation_digest[:16]

    sft_result = project / "results" / "computations" / a / "train" / "result.json"
    trained_sft = sft_result.read_bytes()  # the README's run trained it
    run = run_snakemake(project, *configfile, check=True, timeout=1800)
    ran = re.findall(r"Finished jobid: \d+ \(Rule: (\w+)\)", run.stdout + run.stderr)
    # the SFT demo is the README run's, not trained again: one train, the grpo computation's
    assert ran.count("chain_link") == 1 and ran.count("train") == 1, ran
    assert sft_result.read_bytes() == trained_sft
    assert ran.count("rl_before_after") == 1, ran
    chained = json.loads((project / "results" / "chains" / a / b / "recipe.json").read_text())
    sft_export = project / "results" / "computations" / a / "train" / "export"
    pins = {i["name"]: i["sha256"] for i in chained["inputs"]}
    record = json.loads((sft_export / "model.json").read_text())
    listed = {entry["file"]: entry["sha256"] for entry in record["files"]}
    assert pins["base-weights"] == listed["model.safetensors"]  # grpo starts from the export
    c = reference_logprobs.validated(
        project / "results" / "chains" / a / b / "recipe.json"
    ).computation_digest[:16]
    cdir = project / "results" / "computations" / c
    recipe = json.loads((cdir / "recipe.json").read_text())
    assert json.loads((cdir / "qualification" / "proof.json").read_text())["passed"] is True
    assert (cdir / "publication.json").is_file()

    # DEV mean reward, greedy: the chain's before/after record (the SFT export and the grpo
    # export on the same prompts), its "after" the grpo computation's own evaluation of the
    # checkpoint the export holds (the final state; the DEV-selected one may be another)
    metrics = json.loads((cdir / "eval" / "metrics.json").read_text())
    record = json.loads(
        (project / "results" / "chains" / a / b / "rl-before-after.json").read_text()
    )
    before, after = record["before"]["dev"]["reward"], record["after"]["dev"]["reward"]
    (final,) = [c for c in metrics["checkpoints"] if c["state_hash"] == metrics["final_state_hash"]]
    assert final["step"] == recipe["limits"]["max_steps"]
    assert after == final["dev"]["dev_reward"]
    assert [c["passed"] for c in record["checks"]] == [True]  # max_dev_reward_drop
    # the before figure by hand: the SFT export's greedy answers compared with each answer,
    # generated in a process compiled as the pipeline's (greedy tokens are that setting's)
    dev = project / "data" / "grpo-demo" / "dev.jsonl"
    budget = recipe["rl"]["max_completion_length"]
    right = in_a_started_process(GREEDY_RIGHT, sft_export, dev, budget, compiled=PRODUCTION)
    assert before == pytest.approx(np.mean(right))
    gate = recipe["evaluation"]["min_dev_reward"]
    assert after >= gate, (before, after, gate)
    # rose; an SFT export that already answers every DEV prompt (another machine's floating
    # point) can only hold, and the rollouts below must still show the gain
    assert after > before or before == after == 1.0, (before, after)

    # sampled success at temperature 1 (the training prompts): the rollouts files of the
    # attempt, whose means are the update events' reward
    attempt = project / json.loads((cdir / "train" / "result.json").read_text())["attempt_dir"]
    by_file = rollout_rewards(attempt)
    events = [json.loads(line) for line in (attempt / "events.jsonl").read_text().splitlines()]
    by_event = {e["step"]: e["reward"] for e in events if e["type"] == "update"}
    assert sorted(by_file) == list(range(1, recipe["limits"]["max_steps"] + 1))
    assert by_file == pytest.approx(by_event, abs=1e-12)
    updates = sorted(by_file)
    first = np.mean([by_file[u] for u in updates[:ENDS]])
    last = np.mean([by_file[u] for u in updates[-ENDS:]])
    assert last > first, (first, last)

    again = run_snakemake(project, *configfile, "-n", check=True)
    assert "Nothing to be done" in again.stdout + again.stderr
