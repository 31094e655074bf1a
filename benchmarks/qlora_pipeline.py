"""A LoRA run on an NF4 base through the pipeline's stages, each timed and its peak memory
recorded, into one JSON file (docs/quantized-base.md, "The 8B pipeline on the chip").

The base is a random Llama (``_random_base.py``: drawn by threads into its files, no download)
beside the Llama demo's tokenizer and data (``data/llama-base``, ``data/llama-sft-demo``);
``minifield recipe new`` pins it all into a recipe like the demo's, with ``model.lora``
(rank 16 on every linear layer, NF4 blocks of 64, double quantization, a BF16 base),
``model.scan_layers``, ``training.remat: full``, rows of ``--seq`` tokens. Then the stages,
each in a process of its own, run by the pipeline's own functions:

- ``prepare``: ``preparation.validate``, ``preparation.prepare`` (the examples, the base) and
  ``preparation.quantize_base`` (the NF4 codes, made once on the host: the product every
  later stage reads, as the pipeline's ``quantize_base`` rule makes it);
- ``train``: ``training.train_attempt`` (the supervised worker, given the product; it also
  exports the final weights, merged on the host). Its record holds the worker's ``compiled``
  event's ``memory`` (the compiled update's memory analysis: its ``peak`` is the figure the
  issue's goals are about, NF4 ≤ 8 GB) and the final export's size; the final export (the
  attempt's and the stage's copy of it) is then deleted: no later stage reads it, and at 8B
  its 2 × 16 GB would not leave the chip host's disk (79 GB free) room for the selected
  export and the store's copy;
- ``evaluate``: ``evaluation.evaluate`` as the pipeline's evaluate stage calls it: DEV for every
  checkpoint on the product's codes, the selection, TEST and the selected checkpoint's export
  (merged on the host tensor by tensor, and the PEFT adapter); on a TPU recipe in the
  evaluation's own process, whose log line gives the device's peak, given the computation's
  compilation cache (the worker's evaluation programs loaded from it);
- ``publish``: ``store.publish_computation`` into a store under ``--dir`` (no recovery proof:
  the store records why);
- ``activate``: the store's activation gate on the published artifact, on the CPU as
  ``minifield store activate`` runs it; its re-evaluation reads the export a layer at a time
  (``training.evaluator.StreamedEvaluator``, the path an 8B export takes, taken here at every
  preset). Without a recovery proof the gate refuses the artifact for that alone: any other
  reason fails the stage.

``--backend tpu`` makes it a TPU recipe (``runtime.backend``: the TPU's defaults, splash
attention among them). Each stage's record: its exit, seconds, the process's peak resident
memory (its children's too), and, where that process opened the device, the device's ``peak_bytes_in_use``. A stage
that fails is recorded with its error's last lines, and the stages after it are not run;
``--from STAGE`` starts at a stage whose predecessors' files ``--dir`` holds and ``--to STAGE``
ends at one (a call of its own for a stage that needs one); ``--out`` is rewritten after every
stage. While a stage runs, this process reads the host's available memory every second (each
record holds its lowest, ``available_min_bytes``) and stops the stage's processes when it
falls under ``--min-available-gb`` or the stage runs past ``--stage-limit`` seconds, recording
why and the largest processes then: a stage that would run the chip's host out of memory, or
past its call, is stopped while its figures can still be written::

    python3 benchmarks/qlora_pipeline.py --preset llama-3.1-8b --seq 2048 --backend tpu \\
        --dir /tmp/q8 --out $OUT/qlora-pipeline.json                  # the chip
    uv run python benchmarks/qlora_pipeline.py --preset tiny --seq 64 --dir /tmp/q --out q.json
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _random_base  # noqa: E402
import qlora_step  # noqa: E402
from _stage_watch import watched  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
STAGES = ("prepare", "train", "evaluate", "publish", "activate")
#: stages whose process may open the device (the others keep off it: the supervisor starts the
#: worker, the evaluation its own process, and activation runs on the CPU as `minifield store
#: activate` runs it)
ON_DEVICE = ("publish",)


def arguments(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=sorted(qlora_step.PRESETS), default="tiny")
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--backend", choices=("any", "tpu"), default="any",
                        help="the recipe's runtime.backend")  # fmt: skip
    parser.add_argument("--dir", type=Path, required=True, help="inputs, results, the store")
    parser.add_argument("--out", type=Path, help="the JSON record (the parent's)")
    parser.add_argument(
        "--from",
        dest="first",
        choices=STAGES,
        default=STAGES[0],
        help="the first stage to run (--dir holds the earlier ones' files)",
    )
    parser.add_argument("--to", dest="last", choices=STAGES, default=STAGES[-1],
                        help="the last stage to run (a device call's 10 minutes)")  # fmt: skip
    parser.add_argument("--min-available-gb", type=float, default=0.0,
                        help="stop a stage when the host's available memory falls under this "
                             "(its record says so and names the largest processes; 0: never)")  # fmt: skip
    parser.add_argument("--stage-limit", type=float, default=0.0,
                        help="stop a stage that runs longer, in seconds (0: never)")  # fmt: skip
    parser.add_argument("--stage", choices=STAGES, help=argparse.SUPPRESS)  # one child's
    return parser.parse_args(argv)


def write_inputs(args) -> Path:
    """The input root: the random base (skipped when written), the demo's tokenizer and data;
    returns the recipe ``recipe new`` wrote and this script completed."""
    root = args.dir / "in"
    base = root / "base"
    if not (base / "config.json").is_file():
        _random_base.write(base, qlora_step.base_config(args), seed=0, dtype="bfloat16")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(REPO / "data" / "llama-base" / name, base / name)
    (root / "sft").mkdir(parents=True, exist_ok=True)
    for split in ("train", "dev", "test"):
        name = f"{split}.jsonl"
        shutil.copyfile(REPO / "data" / "llama-sft-demo" / name, root / "sft" / name)
    recipe = args.dir / "recipe.yaml"
    data = ["--train", "sft/train.jsonl", "--dev", "sft/dev.jsonl", "--test", "sft/test.jsonl"]
    command = [sys.executable, "-m", "minifield.cli", "recipe", "new", "--like",
               str(REPO / "config/recipes/llama-sft-demo.yaml"), "--base", "base", *data,
               "--input-root", str(root), "-o", str(recipe), "--force"]  # fmt: skip
    subprocess.run(command, check=True, capture_output=True, text=True, cwd=root)
    return complete(recipe, args)


def complete(path: Path, args) -> Path:
    """The LoRA settings of the module's docstring on the written recipe."""
    import yaml

    recipe = yaml.safe_load(path.read_text())
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    recipe["model"].update(
        scan_layers=True,
        lora={"rank": args.rank, "alpha": float(2 * args.rank), "targets": targets,
              "base_dtype": "bfloat16", "base_quantization": "nf4", "double_quantization": True},
    )  # fmt: skip
    recipe["training"].update(seq_len=args.seq, batch_size=1, warmup_steps=1, remat="full",
                              loss_chunk_tokens=min(1024, args.seq))  # fmt: skip
    recipe["limits"] = {"max_steps": args.steps}
    if args.backend != "any":
        recipe["runtime"] = {**recipe.get("runtime", {}), "backend": args.backend}
    recipe["checkpoint"] = {"every_steps": max(1, args.steps // 2), "keep": 2}
    recipe["evaluation"] = {"eval_every": 0, "batch_size": 1, "max_generate_examples": 2,
                            "min_dev_exact_match": 0.0, "export_max_shard_size": "2GB",
                            "export_dtype": "bfloat16"}  # fmt: skip
    out = args.dir / "recipe.json"
    out.write_text(json.dumps(recipe, indent=1))
    return out


# -- the stages, each in its own process ---------------------------------------------------------
def _paths(args) -> dict[str, Path]:
    d = args.dir
    return {"recipe": d / "recipe.json", "validated": d / "validated.json",
            "examples": d / "examples", "quantized": d / "quantized", "work": d / "work", "result": d / "train" / "result.json",
            "final": d / "train" / "export", "metrics": d / "eval" / "metrics.json",
            "export": d / "eval" / "selected", "store": d / "store",
            "publication": d / "publication.json"}  # fmt: skip


def stage_train(p) -> dict:
    """The supervised worker on the product; the compiled update's memory from its events,
    the final export's size (the export then deleted: see the module)."""
    from minifield.attempt import events as attempt_events
    from minifield.pipeline import training

    out = training.train_attempt(p["validated"], p["recipe"].parent / "in", p["examples"],
                                 p["work"], p["result"], p["final"], p["recipe"].parent / "train.log",
                                 quantized_base_dir=p["quantized"])  # fmt: skip
    attempt = Path(json.loads(p["result"].read_text())["attempt_dir"])
    events, _ = attempt_events.read(attempt / "events.jsonl")
    compiled = [e for e in events if e["type"] == "compiled"]
    exported = sum(f.stat().st_size for f in p["final"].rglob("*") if f.is_file())
    for copy in (p["final"], attempt / "export"):  # the stage's copy and the attempt's
        shutil.rmtree(copy)
    return {"status": out.get("status"), "steps": out.get("steps_completed"),
            "compiled_memory": compiled[-1].get("memory") if compiled else None,
            "compile_seconds": compiled[-1]["seconds"] if compiled else None,
            "final_export_bytes": exported}  # fmt: skip


def stage_evaluate(p) -> dict:
    """The pipeline's evaluate stage: DEV, the selection, TEST, the selected export."""
    import re

    from minifield.attempt.options import computation_cache
    from minifield.pipeline import evaluation

    log = p["recipe"].parent / "evaluate.log"
    shutil.rmtree(p["export"], ignore_errors=True)
    metrics = evaluation.evaluate(p["validated"], p["result"], p["examples"], p["metrics"],
                                  p["export"], log=log, quantized_base_dir=p["quantized"],
                                  compilation_cache=computation_cache(p["work"]))  # fmt: skip
    text = log.read_text() if log.is_file() else ""  # none where it ran in this process
    peaks = re.findall(r"the device's peak (\d+) bytes", text)
    return {"selected_dev": metrics["selected_dev"], "test": metrics["test"],
            "evaluation_device_peak_bytes": int(peaks[-1]) if peaks else None,
            "export_bytes": sum(f.stat().st_size for f in p["export"].rglob("*") if f.is_file())}  # fmt: skip


def stage_activate(p) -> dict:
    """The activation gate on the published artifact (``Store.activate``: every check, the
    re-evaluation a layer at a time); refused for its missing recovery proof alone."""
    from minifield import store
    from minifield.strategies.lm import export_format
    from minifield.training import evaluator

    # the path an 8B export takes (its FP32 parameters are 32 GB), at every preset
    evaluator.STREAM_ABOVE_BYTES = 0
    content_id = json.loads(p["publication"].read_text())["content_id"]
    where = store.Store(p["store"])
    try:
        report = where.activate(content_id)
        reasons, reevaluation = [], report["reevaluation"]
    except store.Refused as exc:
        reasons, reevaluation = exc.reasons, exc.reevaluation
    other = [r for r in reasons if not r.startswith("missing provenance: recovery_proof")]
    if other or reevaluation is None:
        raise SystemExit("activation's gate refused: " + "; ".join(other or reasons))
    return {"reevaluation": reevaluation, "refused_for": reasons,
            "streamed": export_format.streams(where.artifact_dir(content_id))}  # fmt: skip


def run_stage(args) -> dict:
    from minifield.pipeline import preparation

    p = _paths(args)
    if args.stage == "prepare":
        preparation.validate(p["recipe"], p["validated"], args.dir / "validation.json")
        preparation.prepare(p["validated"], args.dir / "in", p["examples"])
        started = time.monotonic()
        preparation.quantize_base(p["validated"], p["examples"], p["quantized"])
        return {"quantize_seconds": round(time.monotonic() - started, 2)}
    if args.stage == "train":
        return stage_train(p)
    if args.stage == "evaluate":
        return stage_evaluate(p)
    if args.stage == "activate":
        return stage_activate(p)
    from minifield import store

    record = store.publish_computation(
        p["store"], p["export"], p["validated"], p["result"], p["metrics"], None,
        p["publication"], no_proof="benchmarks/qlora_pipeline.py: no recovery proof",
    )  # fmt: skip
    return {"content_id": record.get("content_id")}


def measured(args) -> dict:
    """This child's stage and its figures (see the module)."""
    started = time.monotonic()
    figures = run_stage(args)
    seconds = time.monotonic() - started
    device_peak = None
    if args.stage in ON_DEVICE:
        import jax

        device_peak = (jax.devices()[0].memory_stats() or {}).get("peak_bytes_in_use")
    rss = {who: resource.getrusage(who).ru_maxrss * 1024
           for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)}  # fmt: skip
    return {**figures, "seconds": round(seconds, 2), "device_peak_bytes": device_peak,
            "host_peak_rss_bytes": rss[resource.RUSAGE_SELF],
            "children_peak_rss_bytes": rss[resource.RUSAGE_CHILDREN]}  # fmt: skip


def written(record: dict, out: Path | None) -> str:
    """The record as JSON, also into ``out`` when given."""
    text = json.dumps(record, indent=1, sort_keys=True) + "\n"
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text)
    return text


def main(argv=None) -> int:
    args = arguments(argv)
    if args.stage:
        print(json.dumps(measured(args)))
        return 0
    from minifield.supervision import accelerator

    accelerator.keep_off()  # only a stage's process opens the device (one at a time)
    started = time.monotonic()
    write_inputs(args)
    record = {"preset": args.preset, "seq": args.seq, "steps": args.steps, "rank": args.rank,
              "inputs_seconds": round(time.monotonic() - started, 2), "stages": {}}  # fmt: skip
    for stage in STAGES[STAGES.index(args.first) : STAGES.index(args.last) + 1]:
        env = accelerator.worker_env() if stage in ON_DEVICE else None
        command = [sys.executable, __file__, *(argv or sys.argv[1:]), "--stage", stage]
        began = time.monotonic()
        code, stdout, stderr, watch = watched(
            command, env, args.min_available_gb * 1e9, args.stage_limit
        )
        wall = round(time.monotonic() - began, 2)
        if code != 0 or "stopped" in watch:
            tail = (stdout + stderr).strip()[-2000:]
            record["stages"][stage] = {"exit": code, "wall_seconds": wall, **watch, "error": tail}
            why = watch.get("stopped", f"failed (exit {code})")
            print(f"{stage}: {why}, after {wall} s", file=sys.stderr)
            break
        figures = json.loads(stdout.strip().splitlines()[-1])
        record["stages"][stage] = {"exit": 0, "wall_seconds": wall, **watch, **figures}
        print(f"{stage}: {wall} s", file=sys.stderr)
        written(record, args.out)  # a call cut short still brings back the stages it finished
    print(written(record, args.out), end="")
    return 0 if all(s["exit"] == 0 and "stopped" not in s for s in record["stages"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
