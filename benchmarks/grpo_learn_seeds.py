"""The grpo-learn demo over seeds (docs/grpo-demo.md "From a weak start").

The chain ``config/grpo-learn.yaml`` runs, without Snakemake: the weak SFT stage
(``config/recipes/llama-sft-weak.yaml``) trained once by a real worker; its export linked into
``config/recipes/grpo-learn.yaml`` (``chain_base.base_recipe``, as the chain's link does); then,
per ``--seeds`` (the grpo recipe's ``training.seed``: the order of the prompts and every
rollout's draws), the grpo computation trained by a real worker (a seed whose attempt is
already under ``--work`` is not trained again). For each seed one JSON line: DEV greedy reward
before (the SFT export) and after (the grpo export), measured as the chain's ``rl_before_after``
step measures them (``rl_before_after.figures``); the sampled success at temperature 1 of both
(``grpo_demo_sampled.measure``, 16 samples a prompt); the grpo computation's own final
``dev_reward``; the attempt's seconds from start to end (``result.json``); and the reward
curve, the mean reward of the rollouts over each tenth of the updates.

    uv run --locked python benchmarks/grpo_learn_seeds.py --work /tmp/learn --seeds 0 1 2
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from datetime import datetime
from pathlib import Path

import yaml
from grpo_demo_sampled import measure

import minifield
from minifield.pipeline import rl_before_after
from minifield.strategies.lm import chain_base
from minifield.supervision import accelerator

REPO = Path(__file__).resolve().parents[1]
RECIPES = REPO / "config" / "recipes"
DATA = REPO / "data"


def _worker(recipe: Path, input_root: Path, output_root: Path) -> Path:
    """One attempt of ``recipe`` by ``minifield-worker`` (unless done): its directory."""
    if not list(output_root.glob("*/a/result.json")):
        shutil.rmtree(output_root, ignore_errors=True)
        command = [sys.executable, "-m", "minifield.worker", "--job", str(recipe)]
        command += ["--input-root", str(input_root), "--output-root", str(output_root)]
        done = subprocess.run(
            [*command, "--attempt-id", "a"],
            capture_output=True,
            text=True,
            env=accelerator.worker_env(),
        )
        if done.returncode != 0:
            raise SystemExit(f"worker exited {done.returncode} on {recipe}:\n{done.stderr[-3000:]}")
    (attempt,) = output_root.glob("*/a")
    return attempt


def _seconds(result: dict) -> float:
    started, ended = (datetime.fromisoformat(result[key]) for key in ("started", "ended"))
    return round((ended - started).total_seconds(), 1)


def _curve(attempt: Path, parts: int = 10) -> list[float]:
    events = [json.loads(line) for line in (attempt / "events.jsonl").read_text().splitlines()]
    rewards = [e["reward"] for e in events if e["type"] == "update"]
    size = len(rewards) // parts
    return [round(sum(rewards[i : i + size]) / size, 3) for i in range(0, size * parts, size)]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    args = parser.parse_args(argv)
    # only a worker opens the accelerator: this parent runs JAX on the CPU, if at all
    # (minifield.supervision.accelerator); the processes it measures get worker_env
    accelerator.keep_off()
    dev = DATA / "grpo-learn" / "dev.jsonl"
    sft = _worker(RECIPES / "llama-sft-weak.yaml", DATA, args.work / "sft")
    written = yaml.safe_load((RECIPES / "grpo-learn.yaml").read_text())
    linked = chain_base.base_recipe(written, sft / "export")
    checked = minifield.validate(linked).recipe.data  # defaults filled, as the step reads it
    before = rl_before_after.figures(checked, sft / "export", dev, {})["reward"]
    sampled_before = measure(sft / "export", dev, 16, 1.0)["sampled_success"]
    for seed in args.seeds:
        root = args.work / f"seed-{seed}"
        inputs = root / "inputs"
        if not inputs.exists():
            shutil.copytree(DATA / "grpo-learn", inputs / "grpo-learn")
            shutil.copytree(sft / "export", inputs / chain_base.PRODUCT_DIR)
        recipe = {**linked, "training": {**linked["training"], "seed": seed}}
        (root / "recipe.json").write_text(json.dumps(recipe, indent=2))
        attempt = _worker(root / "recipe.json", inputs, root / "out")
        result = json.loads((attempt / "result.json").read_text())
        line = {
            "seed": seed,
            "dev_greedy_before": before,
            "dev_greedy_after": rl_before_after.figures(checked, attempt / "export", dev, {})[
                "reward"
            ],
            "dev_sampled_before": round(sampled_before, 3),
            "dev_sampled_after": round(
                measure(attempt / "export", dev, 16, 1.0)["sampled_success"], 3
            ),
            "dev_reward_computation": result["metrics"].get("dev_reward"),
            "attempt_seconds": _seconds(result),
            "reward_curve": _curve(attempt),
        }
        print(json.dumps(line), flush=True)
        with (args.work / "runs.jsonl").open("a") as stream:
            stream.write(json.dumps(line) + "\n")


if __name__ == "__main__":
    main()
