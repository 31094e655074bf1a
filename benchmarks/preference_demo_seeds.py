"""The preference demo's before/after check over seeds (docs/preference.md "Over seeds and machines").

The chain the demo runs, without Snakemake, the way ``tests/test_before_after.py`` builds it:
the Llama SFT demo (``config/recipes/llama-sft-demo.yaml``, ``training.seed`` = each of
``--sft-seeds``) trained by a real worker; its export linked into the preference demo recipe
(``chain_base.base_recipe``); the reference log-probabilities computed from it
(``reference_logprobs.compute``) and pinned (``reference_link.reference_recipe``); then, per
``--seeds`` (the preference recipe's ``training.seed``) and per ``--set`` variant, the DPO
computation trained by a real worker and measured by ``before_after.figures`` on DEV, the
measure the ``before_after`` rule checks. The SFT export, its reference and its DEV figures
are computed once per SFT seed and kept under ``--work`` (reused by later invocations: a
seed of the preference recipe costs one 40-update worker run plus one DEV measure).

One JSON line per (SFT seed, preference seed, variant) is appended to ``--out``: Python and
jax versions, the seeds, the variant, DEV before and after (exact-match, preference accuracy,
mean margin), the change of exact-match, whether the rule's check (``before_after.check``:
after ≥ before − tolerance) passes, and the DPO computation's own DEV metrics.
``--summarize FILE...`` prints, per file, variant and Python, the change's min / median / max,
the fails and the median change of the DEV margin.

    uv run --locked python benchmarks/preference_demo_seeds.py --work /tmp/seeds \\
        --sft-seeds 0 1 2 3 4 --seeds 0 1 2 3 4 [--set training.learning_rate=3e-5 ...]
    uv run --locked python benchmarks/preference_demo_seeds.py --summarize /tmp/seeds/runs.jsonl

Python 3.12 (the lock covers 3.11 and 3.12, with different jax releases, so other XLA
kernels): an environment made by ``UV_PROJECT_ENVIRONMENT=.venv-3.12 uv sync --locked
--python 3.12``, then ``.venv-3.12/bin/python benchmarks/preference_demo_seeds.py ...`` (its
runs go under ``WORK/py3.12``). The measurements of docs/preference.md "Over seeds and
machines" took about 25 s per preference seed on a 2-core machine.
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import jax
import yaml

from minifield.pipeline import before_after, reference_logprobs
from minifield.strategies.lm import chain_base
from minifield.strategies.preference import reference_link
from minifield.supervision import accelerator

REPO = Path(__file__).resolve().parents[1]
RECIPES = REPO / "config" / "recipes"


def _worker(recipe: Path, input_root: Path, output_root: Path) -> Path:
    """One attempt of ``recipe`` by ``minifield-worker``; its export directory."""
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
    (export,) = output_root.glob("*/a/export")
    return export


def _write(path: Path, data: dict) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2))
    return path


def _assign(recipe: dict, setting: str) -> str:
    """``a.b=value`` (value as JSON, else YAML; ``a.b=`` removes the key) applied to ``recipe``."""
    key, _, value = setting.partition("=")
    *parents, last = key.split(".")
    node = recipe
    for part in parents:
        node = node.setdefault(part, {})
    if value == "":
        node.pop(last, None)
    else:
        try:
            node[last] = json.loads(value)  # 1e-4 is a number (YAML 1.1 reads it as a string)
        except ValueError:
            node[last] = yaml.safe_load(value)
    return setting


def _upstream(work: Path, sft_seed: int, preference_recipe: dict) -> tuple[dict, dict]:
    """The recipe linked on the SFT export of ``sft_seed`` (reference pinned), DEV before.

    The export, the reference and the DEV figures are kept in ``work`` and reused; the link
    is redone on each call from the recipe as written now (the reference digest does not
    cover the loss, β or the optimizer, so one reference serves every variant)."""
    here = work / f"sft-{sft_seed}"
    record = here / "upstream.json"
    inputs = here / "inputs"
    if not record.is_file():
        if here.exists():
            shutil.rmtree(here)
        data = here / "data"
        for part in ("llama-base", "llama-sft-demo", "preference-demo"):
            shutil.copytree(REPO / "data" / part, data / part)
        sft = yaml.safe_load((RECIPES / "llama-sft-demo.yaml").read_text())
        sft["training"]["seed"] = sft_seed
        start = time.monotonic()
        export = _worker(_write(here / "sft.json", sft), data, here / "sft")
        print(f"sft seed {sft_seed}: trained in {time.monotonic() - start:.0f} s", flush=True)
        shutil.copytree(data / "preference-demo", inputs / "preference-demo")
        shutil.copytree(export, inputs / chain_base.PRODUCT_DIR)
        linked = _write(here / "chained.json", chain_base.base_recipe(preference_recipe, export))
        reference_logprobs.compute(linked, inputs, inputs / reference_link.PRODUCT_DIR)
        before = before_after.figures(export, inputs / "preference-demo" / "dev.jsonl")
        _write(record, {"export": str(export), "before": before})
    known = json.loads(record.read_text())
    linked = chain_base.base_recipe(preference_recipe, Path(known["export"]))
    recipe = reference_link.reference_recipe(linked, inputs / reference_link.PRODUCT_DIR)
    return recipe, known["before"]


def summarize(paths: list[Path]) -> None:
    """Per (variant, Python): runs, DEV exact-match change min / median / max, fails, DEV
    margin change median (the last line of a repeated run counts)."""
    runs = {}
    for path in paths:
        for line in Path(path).read_text().splitlines():
            row = json.loads(line)
            runs[(path.name, row["variant"], row["python"], row["sft_seed"], row["seed"])] = row
    groups = {}
    for (name, variant, python, *_), row in runs.items():
        groups.setdefault((name, variant, python), []).append(row)
    for (name, variant, python), rows in groups.items():
        change = sorted(r["dev_exact_match_change"] for r in rows)
        margin = statistics.median(
            r["after"]["mean_margin"] - r["before"]["mean_margin"] for r in rows
        )
        fails = sum(not r["passed"] for r in rows)
        print(
            f"{name} {variant} py{python}: {len(rows)} runs, DEV exact-match change min "
            f"{change[0]:+.2f} median {statistics.median(change):+.2f} max {change[-1]:+.2f}, "
            f"{fails} fail, DEV margin change median {margin:+.2f}"
        )


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--summarize", type=Path, nargs="+", help="only summarize these JSON lines")
    parser.add_argument("--work", type=Path)
    parser.add_argument(
        "--out", type=Path, default=None, help="JSON lines (default WORK/runs.jsonl)"
    )
    parser.add_argument("--sft-seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        dest="settings",
        help="a.b=value applied to the preference recipe (JSON or YAML value; empty removes)",
    )
    args = parser.parse_args(argv)
    # only a worker opens the accelerator: this parent runs JAX on the CPU, if at all
    # (minifield.supervision.accelerator); the processes it measures get worker_env
    accelerator.keep_off()
    if args.summarize:
        return summarize(args.summarize)
    if args.work is None:
        parser.error("--work is required")
    work = args.work.resolve() / f"py{sys.version_info.major}.{sys.version_info.minor}"
    out = args.out or args.work / "runs.jsonl"
    written = yaml.safe_load((RECIPES / "preference-demo.yaml").read_text())
    variant = "-".join(s.replace("=", "_") for s in args.settings) or "demo"
    for sft_seed in args.sft_seeds:
        # the link reads only model.base and the inputs: the variant is applied afterwards
        linked, before = _upstream(work, sft_seed, written)
        for seed in args.seeds:
            recipe = copy.deepcopy(linked)
            for setting in args.settings:
                _assign(recipe, setting)
            recipe["training"]["seed"] = seed
            run = work / f"sft-{sft_seed}" / "runs" / f"{variant}-seed{seed}"
            if run.exists():
                shutil.rmtree(run)
            start = time.monotonic()
            path = _write(run / "recipe.json", recipe)
            export = _worker(path, work / f"sft-{sft_seed}" / "inputs", run / "out")
            after = before_after.figures(
                export, work / f"sft-{sft_seed}" / "inputs" / "preference-demo" / "dev.jsonl"
            )
            own = json.loads((export.parent / "result.json").read_text())["metrics"]
            tolerance = recipe["evaluation"].get(before_after.KEY, 0.02)
            verdict = before_after.check(
                {"before": {"dev": before}, "after": {"dev": after}}, tolerance
            )
            change = after["exact_match"] - before["exact_match"]
            line = {
                "python": platform.python_version(), "jax": jax.__version__,
                "cpu": platform.processor() or platform.machine(),
                "sft_seed": sft_seed, "seed": seed, "variant": variant,
                "settings": args.settings, "before": before, "after": after,
                "dev_exact_match_change": round(change, 6),
                "passed": verdict["passed"],  # the before_after rule's own check
                # the DPO computation's own DEV metrics (packed pairs; its acceptance reads them)
                "own": {k: v for k, v in own.items() if k.startswith("dev_")},
                "seconds": round(time.monotonic() - start, 1),
            }  # fmt: skip
            with out.open("a") as stream:
                stream.write(json.dumps(line) + "\n")
            print(
                f"py{line['python']} sft {sft_seed} seed {seed} {variant}: DEV exact-match "
                f"{before['exact_match']:.2f} -> {after['exact_match']:.2f} ({change:+.2f}), "
                f"margin {before['mean_margin']:.2f} -> {after['mean_margin']:.2f}, "
                f"{'PASS' if line['passed'] else 'FAIL'} ({line['seconds']} s)",
                flush=True,
            )
            shutil.rmtree(run / "out")  # keep the recipe, drop checkpoints and export


if __name__ == "__main__":
    main()
