"""The grpo demo's sampled success: how often an export solves a prompt file's prompts when it
samples (docs/grpo-demo.md "Before and after").

Greedy DEV exact-match (the ``dev_reward`` the grpo computation reports, and the SFT demo's
``dev_exact_match``) says what the most likely answer is; a policy sampled at temperature 1
can still miss often. For each export given, every prompt of ``--prompts`` (a grpo prompt
file, ``{"prompt": ..., "answer": ...}``) is completed ``--samples`` times at
``--temperature`` by the grpo strategy's own rollout generation (:mod:`minifield.rl.rollouts`,
the export's weights, tokenizer, chat template and stop ids; draws from ``(--seed, prompt,
completion)``) and once greedily, each completion scored by the ``exact_match`` reward on the
``answer`` column. Printed and, with ``--out``, appended as JSON lines: the export, the
greedy exact-match, the sampled success (the mean over every completion) and the share of
prompts solved by all / none of their samples.

    uv run --locked python benchmarks/grpo_demo_sampled.py EXPORT [EXPORT ...] \\
        --prompts data/grpo-demo/dev.jsonl [--samples 16 --temperature 1.0 --out runs.jsonl]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from minifield.models.sampling import Sampling
from minifield.rl import rewards, rollouts
from minifield.strategies.grpo import prompts
from minifield.strategies.grpo.evaluator import stop_ids
from minifield.strategies.lm import export_format

REWARDS = [{"kind": "exact_match", "column": "answer"}]
assert not rewards.normalize(REWARDS, [])  # names and absent values filled in, in place


def measure(
    export: Path,
    prompt_file: Path,
    samples: int,
    temperature: float,
    seed: int = 0,
    max_new: int = 20,
    batch: int = 64,
) -> dict:
    """Greedy exact-match and sampled success of ``export`` on ``prompt_file``."""
    model = export_format.ExportedModel(Path(export))
    rows = prompts.read(Path(prompt_file), ["answer"])
    length = model.cfg.max_len
    ids = prompts.encode(rows, model.tokenizer, model.template, length - max_new)
    stops = stop_ids(model.tokenizer)

    def scored(index: np.ndarray, completion: np.ndarray, sampling) -> np.ndarray:
        out = []
        for start in range(0, len(index), batch):
            p, c = index[start : start + batch], completion[start : start + batch]
            made, _ = rollouts.generate(
                model.params, model.cfg, [ids[i] for i in p], max_new, stops,
                sampling=sampling, seed=seed, prompt_index=p, completion_index=c, length=length,
            )  # fmt: skip
            texts = [model.tokenizer.decode(m) for m in made]
            values = rewards.score(
                REWARDS, prompts=[rows[i].prompt for i in p], completions=texts,
                completion_ids=made, columns={"answer": [rows[i].columns["answer"] for i in p]},
                update=0, files={},
            )  # fmt: skip
            out.append(rewards.total(REWARDS, values))
        return np.concatenate(out)

    n = len(rows)
    greedy = scored(np.arange(n), np.zeros(n, np.int64), None)
    index = np.repeat(np.arange(n), samples)
    sampled = scored(index, np.tile(np.arange(samples), n), Sampling(temperature, 0, 1.0))
    per_prompt = sampled.reshape(n, samples).mean(axis=1)
    return {
        "export": str(export),
        "prompts": str(prompt_file),
        "n": n,
        "samples": samples,
        "temperature": temperature,
        "seed": seed,
        "greedy_exact_match": float(greedy.mean()),
        "sampled_success": float(sampled.mean()),
        "all_samples_right": float(np.mean(per_prompt == 1.0)),
        "no_sample_right": float(np.mean(per_prompt == 0.0)),
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("exports", type=Path, nargs="+")
    parser.add_argument("--prompts", type=Path, required=True)
    parser.add_argument("--samples", type=int, default=16)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-new", type=int, default=20)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    for export in args.exports:
        start = time.monotonic()
        line = measure(
            export, args.prompts, args.samples, args.temperature, args.seed, args.max_new
        )
        line["seconds"] = round(time.monotonic() - start, 1)
        print(json.dumps(line), flush=True)
        if args.out:
            with args.out.open("a") as stream:
                stream.write(json.dumps(line) + "\n")


if __name__ == "__main__":
    main()
