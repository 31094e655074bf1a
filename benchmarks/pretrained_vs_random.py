"""The Llama demo from its pretrained base vs the same recipe from a random initialisation.

Runs ``config/recipes/llama-sft-demo.yaml`` as it is (full fine-tuning of the shipped base
model) and a random-init twin at the same budget, each as the pipeline does (validate →
prepare → worker → evaluate: DEV selects the checkpoint, TEST is scored for it), and prints
their DEV/TEST figures side by side as a Markdown table.

The twin differs only where a random start must: no ``model.base``; the dimensions the base's
``config.json`` gives stated in the recipe; ``model.tokenizer: tokenizers-json`` with the
base's own ``tokenizer.json``. Everything else (data, seed, steps, batch, learning rate,
schedule, checkpoints, evaluation) is the demo recipe's. The base's chat template renders an
example as ``<bos>prompt<sep>answer<eos>``, the layout a recipe without a base model trains on,
so both runs train on the same token ids with the same loss mask (checked below).

    uv run --locked python benchmarks/pretrained_vs_random.py [--steps N]
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

import yaml  # noqa: E402

import minifield  # noqa: E402
from minifield import atomic  # noqa: E402
from minifield.inputs import examples  # noqa: E402
from minifield.pipeline import stages  # noqa: E402

DEMO = ROOT / "config/recipes/llama-sft-demo.yaml"
BASE_INPUTS = ("base-config", "base-weights", "base-tokenizer", "base-tokenizer-config")


def random_init_twin(demo: dict) -> dict:
    """The demo recipe without its base model: same data and training, random start."""
    twin = copy.deepcopy(demo)
    twin["job_id"] = demo["job_id"] + "-random-init"
    inputs = {item["name"]: item for item in demo["inputs"]}
    hf = json.loads((ROOT / "data" / inputs["base-config"]["path"]).read_text())
    twin["inputs"] = [i for i in demo["inputs"] if i["name"] not in BASE_INPUTS]
    twin["inputs"].append({**inputs["base-tokenizer"], "name": "tokenizer"})
    twin["model"] = {
        "architecture": "llama",
        "d_model": hf["hidden_size"],
        "n_layers": hf["num_hidden_layers"],
        "n_heads": hf["num_attention_heads"],
        "n_kv_heads": hf["num_key_value_heads"],
        "d_ff": hf["intermediate_size"],
        "rope_theta": hf["rope_theta"],
        "norm_eps": hf["rms_norm_eps"],
        "tie_embeddings": hf["tie_word_embeddings"],
        "compute_dtype": demo["model"].get("compute_dtype", "bfloat16"),
        "tokenizer": {"kind": "tokenizers-json"},
    }
    return twin


@contextlib.contextmanager
def _stdout_to_stderr():
    """File descriptor 1 onto 2 (the worker writes its events to the descriptor itself)."""
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def run_like_the_pipeline(recipe: dict, work: Path) -> tuple[dict, Path]:
    """validate → prepare → one worker attempt → evaluate; returns (metrics.json, examples)."""
    work.mkdir(parents=True)
    raw = work / "raw.json"
    raw.write_text(json.dumps(recipe))
    stages.validate(raw, work / "recipe.json", work / "validation.json")
    prepared = work / "examples"
    stages.prepare(work / "recipe.json", ROOT / "data", prepared)
    with _stdout_to_stderr():  # the attempt's events; stdout is the table
        result = minifield.run(
            work / "recipe.json",
            input_root=ROOT / "data",
            output_root=work / "attempts",
            examples_dir=prepared,
        )
    if not result.ok:
        raise SystemExit(f"{recipe['job_id']}: {result.status} {result.error}")
    # what the train stage records for evaluate: the attempt's result and where it is
    atomic.write_json(
        work / "result.json", {**result.result, "attempt_dir": str(result.attempt_dir)}
    )
    metrics = stages.evaluate(work / "recipe.json", work / "result.json", prepared, work / "m.json")
    return metrics, prepared


#: prepared arrays that must be equal in both runs: every example's tokens and loss mask
SAME_ARRAYS = tuple(
    f"{split}_{name}"
    for split in ("train", "dev", "test")
    for name in ("tokens", "loss_mask", "segments", "positions")
) + tuple(f"{split}_{name}" for split in ("dev", "test") for name in ("prompts", "answers"))


def _same_examples(first: Path, second: Path) -> bool:
    (a, _), (b, _) = examples.load(first), examples.load(second)
    return all(np.array_equal(a[name], b[name]) for name in SAME_ARRAYS)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, help="limits.max_steps for both (default: the demo's)")
    args = parser.parse_args()
    demo = yaml.safe_load(DEMO.read_text())
    if args.steps:
        demo["limits"]["max_steps"] = args.steps
    runs = {"pretrained base": demo, "random init": random_init_twin(demo)}
    out = {}
    with tempfile.TemporaryDirectory(prefix="minifield-pretrained-vs-random-") as tmp:
        for n, (label, recipe) in enumerate(runs.items()):
            out[label] = run_like_the_pipeline(recipe, Path(tmp) / str(n))
        identical = _same_examples(*(prepared for _, prepared in out.values()))
    print(f"same training token ids and loss mask in both runs: {identical}")
    steps = demo["limits"]["max_steps"]
    print(
        f"\n{steps} updates of batch {demo['training']['batch_size']} each, seed "
        f"{demo['training']['seed']}, checkpoint selected on DEV\n"
    )
    print("| start | DEV exact-match | DEV loss | TEST exact-match | TEST loss | selected step |")
    print("|---|---|---|---|---|---|")
    for label, (metrics, _) in out.items():
        dev, test = metrics["selected_dev"], metrics["test"]
        print(
            f"| {label} | {dev['dev_exact_match']:.3f} | {dev['dev_loss']:.3f} | "
            f"{test['test_exact_match']:.3f} | {test['test_loss']:.3f} | "
            f"{metrics['selection']['step']} |"
        )
    print("\nDEV exact-match at each retained checkpoint:")
    for label, (metrics, _) in out.items():
        curve = ", ".join(
            f"{r['step']}: {r['dev']['dev_exact_match']:.3f}" for r in metrics["checkpoints"]
        )
        print(f"- {label}: {curve}")


if __name__ == "__main__":
    main()
