"""The grpo strategy through the worker: it trains, a crash or a SIGKILL anywhere resumes to the
same state hashes and the same rollouts files, the recovery proof passes in both modes, the
evaluate stage selects on DEV reward and the store's gate re-evaluates the export alone.

Independent references: each update's loss is recomputed from its rollouts file alone with
NumPy (TRL's definitions: group advantages with Bessel's std, per-sequence or token-sum
reductions, the k3 KL), and each reward by hand from the completion text."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import attempts_of, read_events, run_attempt, update_hashes, worker_args, write_recipe
from grpo_cases import make_inputs, recipe

from minifield import recipe as recipes
from minifield.data.batches import rows_for_step
from minifield.hf import loaded_model
from minifield.models.sampling import Sampling
from minifield.observe.summarize import summarize
from minifield.pipeline import evaluation, preparation
from minifield.proof.prove import prove
from minifield.rl import rollouts as rl_rollouts
from minifield.strategies.grpo.evaluator import stop_ids

pytestmark = pytest.mark.slow

REWARDS = [
    {"kind": "exact_match", "column": "answer"},
    {"kind": "length", "target": 4, "weight": 0.5},
]
CASES = {
    # full fine-tuning, the per-sequence mean, a reference (k3 KL), two iterations a batch,
    # the update's reward std, and completions cut at 5 tokens left out of the loss
    "full-grpo-kl-mu2": (
        {
            "loss_type": "grpo",
            "beta": 0.04,
            "num_iterations": 2,
            "scale_rewards": "batch",
            "max_completion_length": 5,
            "mask_truncated_completions": True,
        },
        {},
    ),
    # LoRA, the token sum over the update, no reference, GSPO's sequence ratio, unscaled
    # advantages
    "lora-dapo-gspo": (
        {"loss_type": "dapo", "importance_sampling_level": "sequence", "scale_rewards": "none"},
        {"lora": {"rank": 4, "alpha": 8, "targets": ["q_proj", "v_proj", "down_proj"]}},
    ),
}


#: the recovery proof's modes per case. The preemption part (SIGTERM after update 3, a
#: checkpoint committed off the cadence, resumed from it) runs the worker's stop-and-commit
#: path, which is the same for full fine-tuning and LoRA (the checkpoint writer and restore
#: that the crash part checks for both); one case proves it, the other the crash alone (two
#: worker processes and the 3 s the preempted run holds still, fewer).
PROOF_MODES = {"full-grpo-kl-mu2": "both", "lora-dapo-gspo": "crash"}


def _recipe(root, case):
    rl, model = CASES[case]
    raw = recipe(root, {"temperature": 2.5, "rewards": REWARDS, **rl})
    raw["model"].update(model)
    return raw


def rollout_files(attempts) -> dict[str, bytes]:
    """Update file name → bytes over a chain of attempts (later attempts win)."""
    found = {}
    for attempt in attempts:
        for path in sorted((attempt / "rollouts").glob("update-*.jsonl")):
            found[path.name] = path.read_bytes()
    return found


def _rewards_by_hand(line: dict, answers: dict) -> dict:
    completion = line["completion"]
    n = len(line["completion_ids"])
    return {
        "exact_match": float(completion.strip() == answers[line["prompt_index"]]),
        "length": 0.0 if n <= 4 else -(n - 4) / 4,
    }


def _loss_by_hand(lines: list[dict], rl: dict, G: int) -> float:
    """Iteration 1's loss (ratio 1) from a rollouts file, with TRL's definitions: the
    advantage divided by the group's or the whole update's Bessel std (+ 1e-4) or by nothing;
    a truncated completion's tokens left out under ``mask_truncated_completions`` (it still
    counts among the sequences of grpo's mean)."""
    totals = np.asarray([line["total"] for line in lines])
    groups = totals.reshape(-1, G)
    scale = {
        "group": lambda: groups.std(axis=1, ddof=1)[:, None] + 1e-4,
        "batch": lambda: totals.std(ddof=1) + 1e-4,
        "none": lambda: 1.0,
    }[rl.get("scale_rewards", "group")]()
    adv = ((groups - groups.mean(axis=1, keepdims=True)) / scale).ravel()
    for line, a in zip(lines, adv, strict=True):
        assert line["advantage"] == pytest.approx(a, rel=1e-5, abs=1e-6)
    beta = rl.get("beta", 0.0)
    per_sequence, tokens = [], 0
    for line, a in zip(lines, adv, strict=True):
        terms = []
        masked = rl.get("mask_truncated_completions", False) and line["truncated"]
        for t, logp in enumerate([] if masked else line["logps"]):
            kl = 0.0
            if beta:
                d = line["ref_logps"][t] - logp
                kl = np.exp(d) - d - 1
            terms.append(-a + beta * kl)
        per_sequence.append(terms)
        tokens += len(terms)
    if rl["loss_type"] == "grpo":
        return float(np.mean([np.mean(t) if t else 0.0 for t in per_sequence]))
    assert rl["loss_type"] == "dapo"
    return float(sum(sum(t) for t in per_sequence) / tokens)


def _redrawn_from_name(path: Path, recipe: dict, root: Path) -> list[dict]:
    """The rollouts of the update a file's name numbers (``update-{n:08d}.jsonl``, from 1),
    drawn anew as docs/grpo.md says: prompts ``rows_for_step(seed, n - 1)``, keys with
    ``n - 1`` folded in, the policy after ``n - 1`` updates (for ``n`` 1 the base itself)."""
    n = int(path.stem.removeprefix("update-"))
    assert n == 1  # the base is the policy; later updates would need their checkpoint
    base = loaded_model.from_hf_directory(root / "base", compute_dtype="float32")
    rl, training = recipe["rl"], recipe["training"]
    G = rl["num_generations"]
    train = [
        json.loads(line) for line in (root / "prompts" / "train.jsonl").read_text().splitlines()
    ]
    index = rows_for_step(training["seed"], n - 1, training["batch_size"] // G, len(train))
    prompt_ids = [base.prompt_ids(train[i].get("messages") or train[i]["prompt"]) for i in index]
    made = rl_rollouts.sample_groups(
        base.params, base.cfg, prompt_ids, index, G, max_new=rl["max_completion_length"],
        stops=stop_ids(base.tokenizer), seed=training["seed"], update=n,
        sampling=Sampling(rl["temperature"], rl["top_k"], rl["top_p"]), length=training["seq_len"],
    )  # fmt: skip
    return [
        {"prompt_index": int(p), "prompt_ids": a, "completion_ids": c}
        for p, a, c in zip(made.prompt_index, made.prompt_ids, made.completion_ids, strict=True)
    ]


@pytest.mark.parametrize("case", list(CASES))
def test_trains_resumes_to_the_same_rollouts_proves_and_is_gated(tmp_path, case):
    # One set of worker runs serves every check: the recovery proof's (PROOF_MODES). Its
    # reference is the recipe's whole computation (the proof's length is max_steps here: 4
    # updates, export and result included), its crash part a crash after update 3 resumed
    # from the step-2 checkpoint, its preempt part a SIGTERM after update 3 resumed from the
    # checkpoint it made. The test checks each run itself (the proof only compares state
    # hashes): the reference's rewards and losses by hand, the resumed chains' hashes and
    # rollouts files against the reference's, the evaluate stage and the gate on its export.
    root = make_inputs(tmp_path / "in")
    raw = _recipe(root, case)
    path = write_recipe(tmp_path / "recipe.json", raw)
    mode = PROOF_MODES[case]
    proof = prove(path, root, tmp_path / "work", tmp_path / "proof.json", mode=mode)
    assert proof["passed"], proof["diagnosis"]
    assert proof["settings"]["steps"] == raw["limits"]["max_steps"] == 4
    assert proof["settings"]["fail_after_step"] == 3
    assert proof["settings"]["preempt_after_step"] == (3 if mode == "both" else None)
    attempt = Path(proof["reference"]["attempt_dir"])
    assert json.loads((attempt / "result.json").read_text())["status"] == "completed"
    updates = [e for e in read_events(attempt / "events.jsonl") if e["type"] == "update"]
    assert [e["step"] for e in updates] == [1, 2, 3, 4]
    for key in ("rollout_seconds", "reward_seconds", "reference_seconds", "policy_seconds"):
        assert all(e[key] >= 0 for e in updates)
    # each update's rewards by hand, and its loss from its rollouts file alone
    answers = {
        i: json.loads(line)["answer"]
        for i, line in enumerate((root / "prompts" / "train.jsonl").read_text().splitlines())
    }
    G = raw["rl"]["num_generations"]
    for event in updates:
        lines = [
            json.loads(line)
            for line in (attempt / "rollouts" / f"update-{event['step']:08d}.jsonl")
            .read_text()
            .splitlines()
        ]
        assert len(lines) == raw["training"]["batch_size"]
        for line in lines:
            assert line["rewards"] == _rewards_by_hand(line, answers)
            assert line["total"] == pytest.approx(
                line["rewards"]["exact_match"] + 0.5 * line["rewards"]["length"]
            )
        assert event["loss"] == pytest.approx(_loss_by_hand(lines, raw["rl"], G), abs=2e-6)
    assert any(e["reward_std"] > 0 for e in updates)  # the advantages were not all 0
    if raw["rl"].get("mask_truncated_completions"):  # some completions were cut and left out
        cut = [json.loads(x)["truncated"] for p in (attempt / "rollouts").glob("*.jsonl")
               for x in p.read_text().splitlines()]  # fmt: skip
        assert 0 < sum(cut) < len(cut)
    # a crash after update 3, resumed from the step-2 checkpoint: the same states, rollouts;
    # so after the preemption
    crashed = [Path(proof[run]["attempt_dir"]) for run in ("faulted", "resumed")]
    chains = [crashed]
    if mode == "both":
        chains.append([Path(proof["preempted"][run]["attempt_dir"]) for run in ("run", "resumed")])
    assert proof["checkpoint_used"]["step"] == 2
    for resumed in chains:
        assert update_hashes(resumed) == update_hashes([attempt])
        assert rollout_files(resumed) == rollout_files([attempt])
    # the summary's rollouts block over the resumed chain, against the uninterrupted run's events
    rollouts = summarize([a / "events.jsonl" for a in crashed])["rollouts"]
    assert rollouts["updates_count"] == 4
    assert rollouts["reward_first_update"] == updates[0]["reward"]
    assert rollouts["reward_last_update"] == updates[-1]["reward"]
    assert rollouts["reward_mean"] == pytest.approx(np.mean([e["reward"] for e in updates]))
    # the evaluate stage (DEV selection, TEST) and the gate from the export alone
    result = json.loads((attempt / "result.json").read_text())
    recipe_json = tmp_path / "validated.json"
    preparation.validate(path, recipe_json, tmp_path / "validation.json")
    preparation.prepare(recipe_json, root, tmp_path / "examples")
    (tmp_path / "train.json").write_text(json.dumps({**result, "attempt_dir": str(attempt)}))
    metrics = evaluation.evaluate(
        recipe_json, tmp_path / "train.json", tmp_path / "examples", tmp_path / "metrics.json",
        tmp_path / "selected",
    )  # fmt: skip
    dev = metrics["selected_dev"]
    assert {"dev_reward", "dev_pass_at_1", "dev_exact_match"} <= set(dev)
    assert "test_reward" in metrics["test"]
    loaded = recipes.load(recipe_json)
    gate = loaded.strategy.evaluate_export(loaded.data, tmp_path / "selected")
    assert gate["dev_reward"] == pytest.approx(dev["dev_reward"])
    assert gate["dev_exact_match"] == pytest.approx(dev["dev_exact_match"])
    verdict = loaded.strategy.acceptance(loaded.data, gate)
    assert verdict["passed"] and verdict["checks"][0]["name"] == "dev_reward"
    raised = {**loaded.data, "evaluation": {**loaded.data["evaluation"], "min_dev_reward": 9.0}}
    assert not loaded.strategy.acceptance(raised, gate)["passed"]
    # update 1's file redrawn from its name alone: the same prompts and tokens
    first = attempt / "rollouts" / "update-00000001.jsonl"
    recorded = [json.loads(line) for line in first.read_text().splitlines()]
    fields = ("prompt_index", "prompt_ids", "completion_ids")
    assert _redrawn_from_name(first, loaded.data, root) == [
        {name: line[name] for name in fields} for line in recorded
    ]


def _events_count(path) -> int:
    try:
        return sum(1 for line in path.read_text().splitlines() if '"type": "update"' in line)
    except FileNotFoundError:
        return 0


def test_sigkill_at_random_moments_resumes_to_the_same_hashes_and_rollouts(tmp_path):
    root = make_inputs(tmp_path / "in")
    raw = _recipe(root, "full-grpo-kl-mu2")
    raw["limits"]["max_steps"] = 8
    raw["checkpoint"]["every_steps"] = 1
    path = write_recipe(tmp_path / "recipe.json", raw)
    run_attempt(path, root, tmp_path / "out")
    whole = attempts_of(tmp_path / "out", "grpo-test")
    out = tmp_path / "killed"
    rng = random.Random(5)
    previous = None
    for _ in range(2):
        extra = ["--resume-from", str(previous)] if previous else []
        args = worker_args(
            *extra, job=path, input_root=root, output_root=out, record_state_hashes=True
        )
        seen = {p.name for p in out.joinpath("grpo-test").glob("*")} if out.exists() else set()
        proc = subprocess.Popen(
            [sys.executable, "-m", "minifield.worker", *args],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
        )  # fmt: skip
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            new = [p for p in out.joinpath("grpo-test").glob("*") if p.name not in seen]
            if new and _events_count(new[0] / "events.jsonl") >= 1:
                break
            time.sleep(0.01)
        time.sleep(rng.uniform(0.0, 0.15))  # mid-rollout, mid-update or mid-checkpoint
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        previous = attempts_of(out, "grpo-test")[-1]
    run_attempt(path, root, out, "--resume-from", previous)
    chain = attempts_of(out, "grpo-test")
    assert len(chain) == 3  # two killed, one resumed to the end
    assert update_hashes(chain) == update_hashes(whole)
    assert rollout_files(chain) == rollout_files(whole)
