"""Real Snakemake runs of the pipeline on the small linear workload."""

import hashlib
import json
import os
import shutil

import pytest
import yaml
from conftest import REPO, copy_run, run_snakemake, run_worker

from minifield import api

pytestmark = pytest.mark.slow  # every test runs Snakemake or the worker

#: what Snakemake itself prints after a failed run's own last line
SNAKEMAKE_CLOSING = ("Complete log(s):", "Elapsed time:", "WorkflowError:", "At least one job")


def make_project(tmp_path, recipe_edit=None):
    """A user's project directory: config, one recipe, its pinned data."""
    shutil.copytree(REPO / "data" / "linear", tmp_path / "data" / "linear")
    recipe = yaml.safe_load((REPO / "config" / "recipes" / "linear-demo.yaml").read_text())
    if recipe_edit:
        recipe_edit(recipe)
    (tmp_path / "config" / "recipes").mkdir(parents=True)
    (tmp_path / "config" / "recipes" / "linear.yaml").write_text(yaml.safe_dump(recipe))
    (tmp_path / "config" / "config.yaml").write_text(
        yaml.safe_dump(
            {
                "recipes": ["config/recipes/linear.yaml"],
                "input_root": "data",
                "work_dir": "work",
                # the crash proof alone: preemption proofs are tested in test_proof.py
                "qualification": {"mode": "crash"},
            }
        )
    )
    return tmp_path / "config" / "recipes" / "linear.yaml"


def digest_of(recipe_path):
    # the worker's `--validate-only` document, made by the function the worker prints it from,
    # in this process (a worker start per digest cost more than the rest of the check)
    verdict = api.validate(recipe_path).to_json()
    assert verdict["valid"], verdict
    return verdict["computation_digest"]


def test_pipeline_runs_to_evaluation_reruns_nothing_and_keeps_old_digests(
    tmp_path, linear_demo_run
):
    # the session's run of the linear demo through the whole pipeline, in a private copy
    project = copy_run(linear_demo_run, tmp_path / "project")
    recipe_path = project / "config" / "recipes" / "linear-demo.yaml"
    digest = digest_of(recipe_path)
    cdir = project / "results" / "computations" / digest[:16]
    metrics = json.loads((cdir / "eval" / "metrics.json").read_text())
    assert metrics["computation_digest"] == digest
    assert metrics["acceptance"]["passed"] is True
    assert metrics["selection"]["split"] == "dev"
    assert [c["step"] for c in metrics["checkpoints"]] == [2, 4, 6, 8]  # keep: 4 of cadence 2
    result = json.loads((cdir / "train" / "result.json").read_text())
    assert (
        result["status"] == "completed"
        and result["final_state_hash"] == metrics["final_state_hash"]
    )
    inputs = json.loads((cdir / "inputs.json").read_text())["inputs"]
    assert inputs[0]["name"] == "examples"
    # Attempts and checkpoints are in the work dir, never in results/.
    assert (project / "work" / digest[:16] / "attempts").is_dir()
    assert not list((project / "results").rglob("checkpoints"))

    again = run_snakemake(project, check=True)
    assert "Nothing to be done" in again.stdout + again.stderr

    before = (cdir / "eval" / "metrics.json").read_bytes()
    # the new computation's proof: the crash part alone (test_proof.py covers both modes)
    config_path = project / "config" / "config.yaml"
    config = yaml.safe_load(config_path.read_text())
    config["qualification"] = {**config.get("qualification", {}), "mode": "crash"}
    config_path.write_text(yaml.safe_dump(config))
    recipe = yaml.safe_load(recipe_path.read_text())
    recipe["training"]["learning_rate"] = 0.05
    recipe_path.write_text(yaml.safe_dump(recipe))
    new_digest = digest_of(recipe_path)
    assert new_digest != digest
    # up to the new computation's evaluation (publication and capacity add nothing here)
    run_snakemake(project, f"results/computations/{new_digest[:16]}/eval/metrics.json", check=True)
    assert (
        project / "results" / "computations" / new_digest[:16] / "eval" / "metrics.json"
    ).is_file()
    assert (cdir / "eval" / "metrics.json").read_bytes() == before


def test_train_resumes_a_failed_attempt_with_a_fresh_attempt_id(tmp_path, linear_demo_run):
    # the recipe as a user's project writes it (make_project), whose digest names the run
    recipe_path = make_project(tmp_path / "written")
    digest = digest_of(recipe_path)[:16]
    # the reference: the session's uninterrupted pipeline run of the same recipe (one digest)
    reference = json.loads(
        (
            linear_demo_run / "results" / "computations" / digest / "train" / "result.json"
        ).read_text()
    )
    assert reference["status"] == "completed" and not reference.get("resumed_from")
    # A copy of that run whose training never happened: its recipe, examples and recovery
    # proof are there, so Snakemake reruns the train stage alone (the resume is what this
    # test is about; the stages before it are the other tests').
    project = copy_run(linear_demo_run, tmp_path / "project")
    attempts = project / "work" / digest / "attempts"
    shutil.rmtree(project / "results" / "computations" / digest / "train")
    shutil.rmtree(attempts)
    # A crashed attempt left behind in the work dir (hard exit after update 5: checkpoint 4 committed).
    # Snakemake runs a 1-thread job with these thread settings; they are part of the fingerprint.
    snakemake_threads = {
        k: "1" for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")
    }
    run_worker(
        job=recipe_path,
        input_root=project / "data",
        output_root=attempts,
        attempt_id="crashed",
        fail_after_step=5,
        check_codes=[1],
        env=snakemake_threads,
    )
    # up to training: the resume is what this test is about (test time)
    run_snakemake(project, f"results/computations/{digest}/train/result.json", check=True)
    result = json.loads(
        (project / "results" / "computations" / digest / "train" / "result.json").read_text()
    )
    assert result["attempt_id"] != "crashed"
    assert result["resumed_from"].endswith("crashed")
    assert result["final_state_hash"] == reference["final_state_hash"]
    events = [
        json.loads(line)
        for line in (project / result["attempt_dir"] / "events.jsonl").read_text().splitlines()
    ]
    assert next(e for e in events if e["type"] == "restored")["step"] == 4
    # the train stage's worker used the JAX cache this session's environment names (conftest),
    # shared with every computation the suite runs, not one of its own under the work dir
    compiled = next(e for e in events if e["type"] == "compiled")
    assert compiled["compilation_cache"] == os.environ["JAX_COMPILATION_CACHE_DIR"]


def test_invalid_recipe_in_config_stops_before_any_job(tmp_path):
    def break_it(recipe):
        recipe["training"]["momentum"] = 1.5

    make_project(tmp_path, break_it)
    proc = run_snakemake(tmp_path)
    assert proc.returncode != 0
    assert "/training/momentum" in proc.stdout + proc.stderr
    assert not (tmp_path / "results").exists()


def _sha256(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _bad_row_recipe(root) -> dict:
    """The sft demo with an empty answer on line 3 of its train file."""
    shutil.copytree(REPO / "data" / "sft-demo", root / "sft-demo")
    train = root / "sft-demo" / "train.jsonl"
    rows = train.read_text().splitlines()
    rows[2] = json.dumps({**json.loads(rows[2]), "response": ""})
    train.write_text("\n".join(rows) + "\n")
    recipe = yaml.safe_load((REPO / "config" / "recipes" / "sft-demo.yaml").read_text())
    next(item for item in recipe["inputs"] if item["name"] == "train")["sha256"] = _sha256(train)
    return recipe


def _raising_reward_recipe(root) -> dict:
    """A short grpo recipe from the shipped base whose python reward raises (as TRL-style
    reward code does on data it does not expect)."""
    shutil.copytree(REPO / "data" / "llama-base", root / "llama-base")
    (root / "mine").mkdir()
    prompts = (REPO / "data" / "grpo-demo" / "train.jsonl").read_text().splitlines(True)
    for split in ("train", "dev", "test"):
        (root / "mine" / f"{split}.jsonl").write_text("".join(prompts[:16]))
    reward = root / "mine" / "reward.py"
    reward.write_text('def score(completions, **kwargs):\n    raise ValueError("no column x")\n')
    recipe = yaml.safe_load((REPO / "config" / "recipes" / "grpo-demo.yaml").read_text())
    for item in recipe["inputs"]:
        if item["name"] in ("train", "dev", "test"):
            item["path"] = f"mine/{item['name']}.jsonl"
            item["sha256"] = _sha256(root / item["path"])
    recipe["inputs"].append(
        {"name": "reward.py", "path": "mine/reward.py", "sha256": _sha256(reward)}
    )
    recipe["rl"]["rewards"] = [{"kind": "python", "file": "reward.py", "function": "score"}]
    recipe["training"]["batch_size"] = 16
    recipe["limits"]["max_steps"] = 4
    recipe["checkpoint"]["every_steps"] = 2
    del recipe["evaluation"]["max_dev_reward_drop"]  # read in a chain only
    return recipe


def test_each_refusal_ends_the_run_with_one_line_naming_file_line_and_field(tmp_path):
    """Two recipes, each refused by a stage: a packed-sft train file with an empty answer on
    line 3 (prepare), a grpo reward that raises (qualify: the recovery proof's reference run).
    Each stage exits 2 with one line, no traceback; the run's last workflow lines repeat both."""
    root = tmp_path / "data"
    recipes = {"sft.yaml": _bad_row_recipe(root), "rl.yaml": _raising_reward_recipe(root)}
    (tmp_path / "config" / "recipes").mkdir(parents=True)
    for name, recipe in recipes.items():
        (tmp_path / "config" / "recipes" / name).write_text(yaml.safe_dump(recipe))
    config = {
        "recipes": [f"config/recipes/{name}" for name in recipes],
        "input_root": "data",
        "qualification": {"mode": "crash"},
    }
    (tmp_path / "config" / "config.yaml").write_text(yaml.safe_dump(config))
    proc = run_snakemake(tmp_path, "--keep-going")
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "Traceback" not in output, output[-3000:]
    assert output.count("returned non-zero exit status 2") == 2  # each stage's own exit
    workflow_lines = [
        line for line in proc.stderr.splitlines() if not line.startswith(SNAKEMAKE_CLOSING)
    ]
    last = sorted(workflow_lines[-2:])
    assert last[0].startswith(
        f"minifield refused (prepare): {root / 'sft-demo' / 'train.jsonl'}:3: 'response' is empty"
    ), workflow_lines[-5:]
    assert last[1].startswith("minifield refused (qualify): recovery proof of "), last
    assert (
        "the reference run's worker failed (train): RewardError: reward python (function score "
        "of pinned input reward.py) at update 1: the function raised ValueError: no column x"
    ) in last[1]
    assert not list(tmp_path.glob("results/computations/*/train/result.json"))


def test_workflow_lints_clean(tmp_path):
    make_project(tmp_path)
    proc = run_snakemake(tmp_path, "--lint")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Congratulations" in proc.stdout + proc.stderr
