"""The preference strategy through real worker processes: per-update metrics in the events, a
crash resumed to the same state hashes, the recovery proof in both modes (crash and
preemption), the evaluate stage's DEV selection and export, and the store's gate
re-evaluating DEV preference accuracy from the export (checked against the float64 NumPy
forward on the exported weights) and refusing it below the threshold; full fine-tuning with
DPO (reference from ``minifield reference-logprobs``) and LoRA with SimPO. Bad inputs end
the command and the worker with exit 2 and one line."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from conftest import main_in_process, read_events, run_attempt, update_hashes, write_recipe
from family_reference import reference_logits
from preference_cases import make_inputs, recipe, with_reference
from safetensors.numpy import load_file

from minifield import recipe as recipes
from minifield.pipeline import evaluation, preparation
from minifield.proof.prove import prove
from minifield.strategies.lm import export_format
from minifield.strategies.preference import pairs

pytestmark = pytest.mark.slow

LORA = {"rank": 4, "alpha": 8.0, "targets": ["q_proj", "v_proj", "down_proj"]}
METRICS = ("loss", "reward_accuracy", "margin", "chosen_logps", "rejected_logps", "grad_norm")


def _reference_cli(recipe_path, root, out):
    """``minifield reference-logprobs`` through the command line's ``main`` in this process
    (exit code, stdout and stderr as the process gives them; no interpreter and JAX start-up
    per call). The pipeline's ``reference`` rule runs it as a process in the preference
    pipeline tests; the worker's refusals below stay real processes."""
    from minifield import cli

    return main_in_process(
        cli.main, "reference-logprobs", "--recipe", recipe_path, "--input-root", root,
        "--out", out,
    )  # fmt: skip


def _numpy_accuracy(export, encoded):
    """The share of pairs whose chosen answer the exported weights score higher (float64)."""
    hf = json.loads((export / "config.json").read_text())
    weights = load_file(export / "model.safetensors")

    def logp(prompt, answer):
        ids = prompt + answer
        logits = reference_logits(weights, hf, ids)
        top = logits.max(-1, keepdims=True)
        lp = logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True))
        return sum(lp[t - 1, ids[t]] for t in range(len(prompt), len(ids)))

    return np.mean([logp(p.prompt, p.chosen) > logp(p.prompt, p.rejected) for p in encoded])


#: the recovery proof's modes per case. The preemption part (SIGTERM after update 3, a
#: checkpoint committed off the cadence, resumed from it) runs the worker's stop-and-commit
#: path, the same for full fine-tuning and LoRA and for either loss (the checkpoint writer
#: and restore that the crash part checks for both); one case proves it, the other the crash
#: alone (two worker processes and the 3 s the preempted run holds still, fewer).
PROOF_MODES = {"dpo-full": "both", "simpo-lora": "crash"}


@pytest.mark.parametrize("kind", list(PROOF_MODES))
def test_trains_resumes_proves_exports_and_is_gated_on_dev_preference_accuracy(tmp_path, kind):
    root = make_inputs(tmp_path / "in", flip=kind == "dpo-full")
    if kind == "dpo-full":
        # the DPO recipe before its reference exists, as the stage computing it sees it
        unpinned = recipe(root, {"loss": "dpo", "beta": 0.5, "reference": "reference"})
        made = _reference_cli(write_recipe(tmp_path / "dpo.json", unpinned), root, root / "ref")
        assert made.returncode == 0, made.stderr
        assert json.loads(made.stdout)["splits"]["train"]["pairs"] == 24
        raw = with_reference(
            recipe(root, {"loss": "dpo", "beta": 0.5}), root, "ref/reference.safetensors"
        )
    else:
        raw = recipe(root, {"loss": "simpo", "beta": 2.0}, model={"lora": LORA})
    raw["training"]["learning_rate"] = 0.01
    raw["evaluation"]["min_dev_preference_accuracy"] = 0.5
    path = write_recipe(tmp_path / "recipe.json", raw)
    # the recovery proof, as the qualification rule runs it (PROOF_MODES)
    proof = prove(path, root, tmp_path / "work", tmp_path / "proof.json", mode=PROOF_MODES[kind])
    assert proof["passed"], proof["diagnosis"]
    # An uninterrupted run: the proof's reference, which is the recipe's whole computation
    # here (its length is max_steps: 4 updates, export and result included), a real worker
    # recording every update's state hash, as the run this test once started itself (one
    # worker process fewer a case, as tests/test_grpo_worker.py reads its proof's reference).
    assert proof["settings"]["steps"] == raw["limits"]["max_steps"] == 4
    attempt = Path(proof["reference"]["attempt_dir"])
    updates = [e for e in read_events(attempt / "events.jsonl") if e["type"] == "update"]
    assert [e["step"] for e in updates] == [1, 2, 3, 4]
    assert all(np.isfinite(e[m]) for e in updates for m in METRICS)
    result = json.loads((attempt / "result.json").read_text())
    assert result["status"] == "completed" and result["steps_completed"] == 4
    # A crash after update 3 resumed from the step-2 checkpoint reaches the uninterrupted
    # run's state hashes. The proof's crash part is that very crash (every_steps 2 and
    # max_steps 4: fail_after_step 3, 4 steps), so its faulted and resumed attempts serve;
    # the test no longer makes a crash and a resume of its own (two worker processes).
    assert proof["settings"]["fail_after_step"] == 3 and proof["settings"]["steps"] == 4
    proof_attempts = Path(proof["proof_dir"]) / "attempts" / "pref-test"
    crashed = proof_attempts / "faulted"
    crash_updates = [
        e["step"] for e in read_events(crashed / "events.jsonl") if e["type"] == "update"
    ]
    assert crash_updates == [1, 2, 3] and not (crashed / "result.json").exists()
    resumed = [crashed, proof_attempts / "resumed"]
    assert update_hashes(resumed) == update_hashes([attempt])
    # so does the chain its preempt part made (SIGTERM after update 3, resumed)
    if PROOF_MODES[kind] == "both":
        preempted = [Path(proof["preempted"][run]["attempt_dir"]) for run in ("run", "resumed")]
        assert update_hashes(preempted) == update_hashes([attempt])
    # the evaluate stage: DEV selection, TEST, the selected export
    recipe_json = tmp_path / "validated.json"
    preparation.validate(path, recipe_json, tmp_path / "validation.json")
    preparation.prepare(recipe_json, root, tmp_path / "examples")
    (tmp_path / "train.json").write_text(json.dumps({**result, "attempt_dir": str(attempt)}))
    metrics = evaluation.evaluate(
        recipe_json, tmp_path / "train.json", tmp_path / "examples", tmp_path / "metrics.json",
        tmp_path / "selected",
    )  # fmt: skip
    dev = metrics["selected_dev"]
    assert {"dev_preference_accuracy", "dev_reward_accuracy", "dev_loss"} <= set(dev)
    assert "test_preference_accuracy" in metrics["test"]
    # the gate's re-evaluation from the export alone, against the NumPy forward by hand
    loaded = recipes.load(recipe_json)
    gate = loaded.strategy.evaluate_export(loaded.data, tmp_path / "selected")
    model = export_format.ExportedModel(tmp_path / "selected")  # its tokenizer and template
    encoded = pairs.encode(
        pairs.read(root / "pairs" / "dev.jsonl"), model.tokenizer, model.template
    )
    by_hand = _numpy_accuracy(tmp_path / "selected", encoded)
    assert gate["dev_preference_accuracy"] == pytest.approx(by_hand)
    assert gate["dev_preference_accuracy"] == pytest.approx(dev["dev_preference_accuracy"])
    # the DPO run's pairs are flipped (chosen: the near miss the base rejects), so after four
    # updates its DEV preference accuracy is still below the threshold 0.5: refused
    verdict = loaded.strategy.acceptance(loaded.data, gate)
    assert verdict["checks"][0]["name"] == "dev_preference_accuracy"
    assert verdict["passed"] == (kind == "simpo-lora") == (by_hand >= 0.5)


def test_bad_inputs_end_the_command_and_the_worker_with_exit_2_and_one_line(tmp_path):
    root = make_inputs(tmp_path / "in")
    bad = recipe(root, {"loss": "simpo", "beta": 0.0})
    made = _reference_cli(write_recipe(tmp_path / "beta.json", bad), root, tmp_path / "ref")
    assert made.returncode == 2 and "/preference/beta" in made.stderr
    assert len(made.stderr.strip().splitlines()) == 1 and not (tmp_path / "ref").exists()
    # a pair whose answers are equal: the file, the row and the field named
    dev = root / "pairs" / "dev.jsonl"
    rows = dev.read_text().splitlines()
    row = json.loads(rows[2])
    rows[2] = json.dumps({**row, "rejected": row["chosen"]})
    dev.write_text("\n".join(rows) + "\n")
    equal = write_recipe(tmp_path / "equal.json", recipe(root, {"loss": "simpo"}))
    made = _reference_cli(equal, root, tmp_path / "ref")
    assert made.returncode == 2 and f"{dev}:3: 'chosen' equals 'rejected'" in made.stderr
    assert not (tmp_path / "ref").exists()
    worker = run_attempt(equal, root, tmp_path / "out", codes=(2,))
    assert f"{dev}:3" in worker.stderr
    # a DPO recipe whose reference file is missing
    missing = with_reference(recipe(root, {"loss": "dpo"}), root, "pairs/dev.jsonl")
    missing["inputs"][-1]["path"] = "ref/reference.safetensors"
    worker = run_attempt(
        write_recipe(tmp_path / "m.json", missing), root, tmp_path / "o2", codes=(2,)
    )
    assert "ref/reference.safetensors" in worker.stderr
