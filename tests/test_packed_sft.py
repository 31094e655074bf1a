"""packed-sft end to end through the real worker: validation, a run, export, generate, and
recovery — SIGKILL during training, during a checkpoint write and during evaluation, then
resume, must end in the same final state hash as the uninterrupted run."""

from __future__ import annotations

import hashlib
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import (
    TINY_SFT,
    attempts_of,
    export_evaluated_as_started,
    merged,
    minifield_in_process,
    packed_sft_recipe,
    read_events,
    run_attempt,
    update_hashes,
    worker_command,
    write_recipe,
)

from minifield import recipe as recipes
from minifield.data import batches, encoding
from minifield.strategies.lm import export_format
from minifield.strategies.packed_sft import demo_data

MAX_STEPS = 6


@pytest.fixture(scope="module")
def space(tmp_path_factory) -> dict:
    """Tiny demo splits under an input root, a shared compilation cache, an output root."""
    root = tmp_path_factory.mktemp("packed-sft")
    data = root / "in" / "sft"
    data.mkdir(parents=True)
    splits = demo_data.demo_examples(seed=5, sizes={"train": 96, "dev": 12, "test": 12})
    pins = {}
    for split, rows in splits.items():
        blob = encoding.to_jsonl(rows)
        (data / f"{split}.jsonl").write_bytes(blob)
        pins[split] = hashlib.sha256(blob).hexdigest()
    return {"root": root, "input_root": root / "in", "pins": pins, "cache": root / "jax-cache"}


def tiny_recipe(space, **changes) -> dict:
    base = merged(
        TINY_SFT,
        limits={"max_steps": MAX_STEPS},
        evaluation={"eval_every": 2, "max_generate_examples": 8},
    )
    return packed_sft_recipe(space["pins"], "sft-test", **merged(base, **changes))


def _run(space, recipe_path, out, *extra, codes=(0,), cache=True):
    cache = space["cache"] if cache else None
    return run_attempt(recipe_path, space["input_root"], out, *extra, codes=codes, cache=cache)


def _attempts(out: Path) -> list[Path]:
    return attempts_of(out, "sft-test")


@pytest.fixture(scope="module")
def reference(space) -> dict:
    """The uninterrupted run every recovery test compares with."""
    recipe_path = write_recipe(space["root"] / "recipe.json", tiny_recipe(space))
    out = space["root"] / "reference"
    _run(space, recipe_path, out)
    (attempt,) = _attempts(out)
    result = json.loads((attempt / "result.json").read_text())
    return {
        "recipe": recipe_path,
        "attempt": attempt,
        "result": result,
        "hashes": update_hashes([attempt]),
    }


# -- validation -------------------------------------------------------------------------------


def _errors(document) -> dict[str, str]:
    with pytest.raises(recipes.RecipeError) as info:
        recipes.validate(document)
    return {e["path"]: e["message"] for e in info.value.errors}


def test_defaults_fill_in_and_bf16_is_the_default(space):
    recipe = recipes.validate(tiny_recipe(space))
    assert recipe.strategy.name == "packed-sft" and recipe.strategy.version == "12.0.0"
    assert recipe.data["model"]["compute_dtype"] == "bfloat16"
    assert recipe.data["model"]["tokenizer"] == {
        "kind": "byte",
        "input": "tokenizer",
        "special_tokens": {},
    }
    assert recipe.data["training"]["overlong"] == "truncate"


def test_validation_names_each_bad_field(space):
    errors = _errors(tiny_recipe(space, model={"d_model": 30, "n_heads": 4, "colour": "red"}))
    assert "/model" in errors and "colour" in errors["/model"]
    errors = _errors(tiny_recipe(space, training={"overlong": "squeeze", "batch_size": 0}))
    assert "/training/overlong" in errors and "/training/batch_size" in errors
    errors = _errors(tiny_recipe(space, model={"d_model": 30, "n_heads": 4}))
    assert errors == {"/model/n_heads": "must divide model.d_model=30 (got 4)"}
    errors = _errors(tiny_recipe(space, training={"warmup_steps": MAX_STEPS}))
    assert list(errors) == ["/training/warmup_steps"]
    recipe = tiny_recipe(space)
    recipe["inputs"] = recipe["inputs"][:2]
    errors = _errors(recipe)
    assert "missing ['test']" in errors["/inputs"]
    recipe = tiny_recipe(space, model={"tokenizer": {"kind": "tokenizers-json"}})
    assert "missing ['tokenizer']" in _errors(recipe)["/inputs"]
    recipe = tiny_recipe(space, evaluation={"max_generate_examples": 0, "min_dev_exact_match": 0.5})
    assert list(_errors(recipe)) == ["/evaluation/min_dev_exact_match"]


def test_changing_only_the_optimizer_keeps_the_examples_digest(space):
    a = recipes.validate(tiny_recipe(space))
    b = recipes.validate(tiny_recipe(space, training={"learning_rate": 0.02}))
    c = recipes.validate(tiny_recipe(space, training={"seq_len": 48}))
    assert a.computation_digest != b.computation_digest
    assert a.examples_digest == b.examples_digest != c.examples_digest


def test_data_order_is_a_pure_function_of_seed_and_step():
    n_rows, batch = 10, 4
    # update n consumes global positions 4n..4n+3 of the epoch permutations laid end to end
    stream = np.concatenate([batches.epoch_order(3, e, n_rows) for e in range(3)])
    for step in range(6):
        expected = stream[step * batch : (step + 1) * batch]
        assert batches.rows_for_step(3, step, batch, n_rows).tolist() == expected.tolist()
    assert sorted(batches.epoch_order(3, 0, n_rows)) == list(range(n_rows))
    assert batches.epoch_order(3, 0, n_rows).tolist() != batches.epoch_order(4, 0, n_rows).tolist()


# -- a run, its evaluation and its export -------------------------------------------------------


@pytest.mark.slow
def test_worker_run_completes_evaluates_and_exports(reference, space):
    result, attempt = reference["result"], reference["attempt"]
    assert result["status"] == "completed" and result["steps_completed"] == MAX_STEPS
    events = read_events(attempt / "events.jsonl")
    updates = [e for e in events if e["type"] == "update"]
    assert [e["step"] for e in updates] == list(range(1, MAX_STEPS + 1))
    assert all(np.isfinite(e["loss"]) for e in updates)
    # the loss is the token-weighted mean over the trained targets of the batch
    for event in updates:
        assert event["loss"] == pytest.approx(event["loss_sum"] / event["loss_tokens"], rel=1e-5)
        assert 4 <= event["examples"] and event["tokens"] <= 4 * 32
    assert updates[-1]["state_hash"] == result["final_state_hash"]
    # the learning rate each update applied: warmup, then cosine down to ratio x peak at
    # max_steps, written out by hand from the validated recipe's values
    training = recipes.load(reference["recipe"]).data["training"]
    assert training["decay"] == "cosine"
    peak, warmup = training["learning_rate"], training["warmup_steps"]
    floor = peak * training["min_learning_rate_ratio"]
    for event in updates:
        s = event["step"] - 1  # updates applied before this one
        if s < warmup:
            expected = peak * (s + 1) / warmup
        else:
            progress = (s - warmup) / (MAX_STEPS - warmup)
            expected = floor + (peak - floor) * (1 + math.cos(math.pi * progress)) / 2
        assert event["learning_rate"] == pytest.approx(expected, rel=1e-6)
    evaluations = [e for e in events if e["type"] == "evaluation"]
    assert [(e["step"], e["final"]) for e in evaluations] == [(2, False), (4, False), (6, True)]
    final = evaluations[-1]["metrics"]
    assert final["dev_perplexity"] == pytest.approx(np.exp(final["dev_loss"]))
    assert final["dev_generated"] == 8 and 0.0 <= final["dev_exact_match"] <= 1.0
    compiled = [e for e in events if e["type"] == "compiled"][0]
    assert compiled["compilation_cache"] == str(space["cache"])
    assert compiled["attention"] == {"kernel": "xla"}  # the recipe's: no fused kernel
    assert any(space["cache"].iterdir())  # executables were persisted
    # the worker compiled as the suite's started processes do, and recorded it (conftest)
    environment = json.loads((attempt / "attempt.json").read_text())["environment"]
    assert environment["env"]["JAX_DISABLE_MOST_OPTIMIZATIONS"] == "1"

    export_dir = attempt / "export"
    model = json.loads((export_dir / "model.json").read_text())
    config = model["config"]
    assert config["model"]["vocab_size"] == 260 and config["model"]["max_len"] == 32
    assert config["tokenizer"]["kind"] == "byte"
    dev_copy = (export_dir / "dev.jsonl").read_bytes()
    assert hashlib.sha256(dev_copy).hexdigest() == config["dev"]["sha256"] == space["pins"]["dev"]
    # every exported weight is FP32 (master parameters)
    assert {w["dtype"] for w in model["weights"]} == {"<f4"}

    # the store's view: acceptance re-run from the export alone reproduces the run's DEV metrics,
    # computed in a process compiled as the worker was (like with like: the same program on the
    # same FP32 weights gives the same bits)
    recipe = recipes.load(reference["recipe"])
    again = export_evaluated_as_started(reference["recipe"], export_dir)
    assert again["dev_exact_match"] == final["dev_exact_match"]
    assert again["dev_loss"] == final["dev_loss"]
    verdict = recipe.strategy.acceptance(recipe.data, again)
    assert verdict["checks"][0]["name"] == "dev_exact_match" and verdict["passed"]


@pytest.mark.slow
def test_evaluate_export_refuses_a_dev_file_that_is_not_the_pinned_one(reference, tmp_path):
    import shutil

    from minifield.state import export

    copy = tmp_path / "export"
    shutil.copytree(reference["attempt"] / "export", copy)
    (copy / "dev.jsonl").write_text('{"prompt": "abc", "response": "cba"}\n')
    recipe = recipes.load(reference["recipe"])
    with pytest.raises(export.ExportError, match="dev.jsonl: sha256"):
        recipe.strategy.evaluate_export(recipe.data, copy)


@pytest.mark.slow
def test_generate_cli_on_the_exported_model(reference):
    export_dir = reference["attempt"] / "export"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "minifield.cli",
            "generate",
            "--model",
            str(export_dir),
            "--prompt",
            "abc",
            "--prompt",
            "hello",
            "--max-new-tokens",
            "5",
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.split("\n")
    assert len(lines) == 3 and lines[2] == ""  # one line per prompt
    assert all(len(line.encode()) <= 5 for line in lines[:2])
    # the refusal through the same command's main in this process (a process start costs
    # more than the refusal itself; the process path is the run above)
    refused = minifield_in_process("generate", "--model", export_dir.parent, "--prompt", "x")
    assert refused.returncode == 2
    assert "neither a minifield export (model.json missing)" in refused.stderr


# -- recovery -----------------------------------------------------------------------------------


def _resume_and_compare(space, reference, out, previous):
    _run(space, reference["recipe"], out, "--resume-from", previous)
    attempts = _attempts(out)
    result = json.loads((attempts[-1] / "result.json").read_text())
    assert result["status"] == "completed"
    assert result["final_state_hash"] == reference["result"]["final_state_hash"]
    assert (
        update_hashes(attempts) == reference["hashes"]
    )  # every update, before and after the crash
    return attempts


@pytest.mark.slow
def test_sigkill_during_training_then_resume_is_bit_identical(space, reference):
    out = space["root"] / "kill-train"
    proc = _run(space, reference["recipe"], out, "--fail-after-step", "3", codes=(1,))
    assert proc.returncode == 1
    (crashed,) = _attempts(out)
    assert not (crashed / "result.json").exists()  # a hard crash: nothing after update 3
    attempts = _resume_and_compare(space, reference, out, crashed)
    restored = [e for e in read_events(attempts[-1] / "events.jsonl") if e["type"] == "restored"]
    assert restored[0]["step"] == 2
    # the resumed attempt found its step function in the persistent compilation cache
    compiled = [e for e in read_events(attempts[-1] / "events.jsonl") if e["type"] == "compiled"]
    assert compiled[0]["compilation_cache"] == str(space["cache"])


@pytest.mark.slow
def test_sigkill_during_a_checkpoint_write_then_resume_is_bit_identical(space, reference):
    out = space["root"] / "kill-checkpoint"
    proc = _run(
        space, reference["recipe"], out, "--kill-during-checkpoint", "4", codes=(-signal.SIGKILL,)
    )
    assert proc.returncode == -signal.SIGKILL
    (crashed,) = _attempts(out)
    events = read_events(crashed / "events.jsonl")
    # the write runs in the background: updates after 4 may be reported before the kill, but
    # nothing says checkpoint 4 was committed
    assert [(e["type"], e["step"]) for e in events if e["type"] == "fault_kill"] == [
        ("fault_kill", 4)
    ]
    assert not any(e["type"] == "checkpoint_committed" and e["step"] == 4 for e in events)
    checkpoints = crashed / "checkpoints"
    assert (checkpoints / "step-00000002" / "manifest.json").is_file()
    assert not (checkpoints / "step-00000004").exists()
    half = [p for p in checkpoints.iterdir() if p.name.startswith(".tmp-step-00000004")]
    assert half and (half[0] / "arrays.bin").stat().st_size > 0
    assert not (half[0] / "manifest.json").exists()
    attempts = _resume_and_compare(space, reference, out, crashed)
    restored = [e for e in read_events(attempts[-1] / "events.jsonl") if e["type"] == "restored"]
    assert restored[0]["step"] == 2  # the half-written step 4 was never used


@pytest.mark.slow
def test_sigkill_during_evaluation_then_resume_is_bit_identical(space, reference):
    """Kill once step 2 is committed and its periodic evaluation is running (no cache, so the
    evaluation has to compile first and lasts long enough to be hit). The checkpoint is
    written in the background while the evaluation runs, so "committed" is read from the
    disk (its manifest), not from the ``checkpoint_committed`` event, which comes after."""
    out = space["root"] / "kill-eval"
    command = worker_command(
        job=reference["recipe"],
        input_root=space["input_root"],
        output_root=out,
        record_state_hashes=True,
    )
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 240
        events_path = None
        while time.monotonic() < deadline and proc.poll() is None:
            if events_path is None and (out / "sft-test").is_dir():
                found = list((out / "sft-test").glob("*/events.jsonl"))
                events_path = found[0] if found else None
            if (
                events_path is not None
                and (events_path.parent / "checkpoints/step-00000002/manifest.json").is_file()
                and any(e["type"] == "update" and e["step"] == 2 for e in _safe_events(events_path))
            ):
                os.kill(proc.pid, signal.SIGKILL)
                break
            time.sleep(0.005)
    finally:
        proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.read().decode()[-2000:]
    events = read_events(events_path)
    # killed between the checkpoint commit and the end of that evaluation
    assert not any(e["type"] == "evaluation" for e in events)
    assert not any(e["type"] == "update" and e["step"] == 3 for e in events)
    _resume_and_compare(space, reference, out, events_path.parent)


def _safe_events(path: Path) -> list[dict]:
    """Complete lines only: the writer may be in the middle of a line."""
    text = path.read_text()
    lines = text.split("\n")[:-1] if not text.endswith("\n") else text.splitlines()
    return [json.loads(line) for line in lines if line.strip()]


def test_tokenizers_json_recipe_prepares_exports_and_loads(space, tmp_path):
    """The pinned tokenizer.json alternative: packed with its ids, carried into the export."""
    from test_tokenizer import _write_bpe

    from minifield.data import tokenizer
    from minifield.inputs import examples

    path = _write_bpe(space["input_root"] / "sft" / "tokenizer.json")
    recipe = tiny_recipe(space, model={"tokenizer": {"kind": "tokenizers-json", "input": "tok"}})
    recipe["inputs"].append(
        {
            "name": "tok",
            "path": "sft/tokenizer.json",
            "sha256": hashlib.sha256(path.read_bytes()).hexdigest(),
        }
    )
    validated = recipes.validate(recipe)
    files = {i["name"]: space["input_root"] / i["path"] for i in validated.data["inputs"]}
    arrays, meta = validated.strategy.prepare(validated.data, files)
    tok = tokenizer.from_file(path)
    assert meta["tokenizer"]["kind"] == "tokenizers-json"
    assert arrays["train_tokens"].max() < tok.vocab_size
    first = arrays["train_tokens"][0]
    assert first[0] == tok.bos_id and tok.sep_id in first.tolist() and tok.eos_id in first.tolist()
    # through the examples directory (memory-mapped), as training reads them
    examples.write(tmp_path / "ex", arrays, meta, validated.examples_digest)
    loaded, _ = examples.load(tmp_path / "ex", validated.examples_digest)
    program = validated.strategy.build(validated.data, loaded)
    program.export(program.init_state(), tmp_path / "export")
    assert (tmp_path / "export" / "tokenizer.json").read_bytes() == path.read_bytes()
    model = export_format.ExportedModel(tmp_path / "export")
    assert model.cfg.vocab_size == tok.vocab_size
    assert isinstance(model.generate("abc", max_new_tokens=3), str)


@pytest.mark.slow
def test_pipeline_stages_prepare_train_evaluate_select_on_dev_and_test_once(
    space, reference, monkeypatch
):
    """prepare → train (worker subprocess, cache under the work dir) → evaluate, as Snakemake runs them."""
    import shutil

    # the work dir's cache is the default: without a JAX cache named by the environment (the
    # test session names one; the choice is checked below)
    monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR")

    from minifield.pipeline import evaluation, preparation, training

    root = space["root"] / "stages"
    recipe_json = root / "recipe.json"
    preparation.validate(reference["recipe"], recipe_json, root / "validation.json")
    manifest = preparation.prepare(recipe_json, space["input_root"], root / "examples")
    train_stats = manifest["meta"]["splits"]["train"]
    assert train_stats["examples"] == 96 and train_stats["rejected"] == 0
    assert manifest["meta"]["packing_efficiency"] == train_stats["efficiency"]
    work = root / "work"
    # seed the work dir's cache with the module's executables (only to save test time)
    shutil.copytree(space["cache"], work / "jax-cache")
    result = training.train_attempt(
        recipe_json,
        space["input_root"],
        root / "examples",
        work,
        root / "train" / "result.json",
        root / "train" / "export",
        root / "train.log",
    )
    assert result["final_state_hash"] == reference["result"]["final_state_hash"]
    assert any((work / "jax-cache").iterdir())
    # each update's counts match the rows the (seed, step) data order names, read from the
    # memory-mapped examples the worker was given
    from minifield.inputs import examples

    arrays, _ = examples.load(root / "examples")
    n_rows = arrays["train_tokens"].shape[0]
    attempt_dir = Path(json.loads((root / "train" / "result.json").read_text())["attempt_dir"])
    for event in read_events(attempt_dir / "events.jsonl"):
        if event["type"] != "update":
            continue
        rows = batches.rows_for_step(0, event["step"] - 1, 4, n_rows)
        segments, positions = arrays["train_segments"][rows], arrays["train_positions"][rows]
        assert event["tokens"] == int(np.count_nonzero(segments))
        assert event["examples"] == int(np.count_nonzero((positions == 0) & (segments > 0)))
    metrics = evaluation.evaluate(
        recipe_json,
        root / "train" / "result.json",
        root / "examples",
        root / "metrics.json",
        root / "selected-export",
    )
    rows = metrics["checkpoints"]
    assert [r["step"] for r in rows] == [2, 4, 6]  # keep: 3
    assert all(set(r["dev"]) >= {"dev_loss", "dev_exact_match"} for r in rows)
    best = min(rows, key=lambda r: (r["dev"]["dev_loss"], -r["step"]))
    assert metrics["selection"]["step"] == best["step"] and metrics["selection"]["split"] == "dev"
    assert set(metrics["test"]) == {
        "test_loss",
        "test_perplexity",
        "test_exact_match",
        "test_generated",
    }
    assert not any("test_loss" in r["dev"] for r in rows)  # TEST only for the selected one
    # the selected checkpoint's weights are exported and re-evaluate to its DEV figures
    recipe = recipes.load(recipe_json)
    again = recipe.strategy.evaluate_export(recipe.data, root / "selected-export")
    assert again["dev_exact_match"] == best["dev"]["dev_exact_match"]
    assert again["dev_loss"] == pytest.approx(best["dev"]["dev_loss"], rel=1e-6)


def test_pipeline_workers_use_the_jax_cache_the_environment_names_else_the_work_dirs(
    tmp_path, monkeypatch
):
    from minifield.attempt.options import computation_cache

    work = tmp_path / "work" / "0123abcd"
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", str(tmp_path / "shared"))
    assert computation_cache(work) == tmp_path / "shared"
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", "")  # set but empty: JAX's "no cache"
    assert computation_cache(work) == tmp_path / "work" / "0123abcd" / "jax-cache"
    monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR")
    assert computation_cache(work) == tmp_path / "work" / "0123abcd" / "jax-cache"
