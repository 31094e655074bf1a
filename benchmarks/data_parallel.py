"""1 device vs N data-parallel devices: the two loss curves of one small packed-sft recipe.

Runs the real worker twice on CPU: once with ``training.data_parallel.devices: 1`` and one
visible device, once with ``devices: N`` and N forced host devices
(``XLA_FLAGS=--xla_force_host_platform_device_count=N``). Both train on the same rows from
the same initial parameters; only the order of floating-point additions differs (partial
sums per device, then an all-reduce). Prints the curves side by side, the largest absolute
and relative loss difference, the tolerance, and both final complete-state hashes;
optionally writes a PNG.

The timings are those of N *simulated* devices sharing this machine's CPU cores: they say
nothing about the speed-up on N real accelerators.

Usage: uv run python benchmarks/data_parallel.py [--devices 4] [--steps 30] [--shard-params]
       [--png results/data-parallel.png] [--work DIR]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from minifield.data import encoding
from minifield.strategies.packed_sft import demo_data

#: relative loss difference allowed between the 1-device and N-device curves (see
#: docs/data-parallel.md for why)
TOLERANCE = 1e-3


def write_data(root: Path) -> dict[str, str]:
    """The demo reversal task (same generator as ``minifield make-demo-data``), pinned."""
    data = root / "in" / "sft"
    data.mkdir(parents=True, exist_ok=True)
    pins = {}
    for split, rows in demo_data.demo_examples().items():
        blob = encoding.to_jsonl(rows)
        (data / f"{split}.jsonl").write_bytes(blob)
        pins[split] = hashlib.sha256(blob).hexdigest()
    return pins


def recipe(pins: dict, devices: int, steps: int, shard_params: bool) -> dict:
    return {
        "job_id": f"dp-bench-{devices}",
        "product": {"name": "string-reverser", "version": "bench"},
        "strategy": {"name": "packed-sft", "version": "12.0.0"},
        "inputs": [
            {"name": s, "path": f"sft/{s}.jsonl", "sha256": pins[s]}
            for s in ("train", "dev", "test")
        ],
        "model": {"d_model": 64, "n_layers": 2, "n_heads": 4, "d_ff": 256},
        "training": {
            "seq_len": 64,
            "batch_size": 16,
            "learning_rate": 0.003,
            "warmup_steps": 5,
            "data_parallel": {"devices": devices, "shard_params": shard_params and devices > 1},
        },
        "limits": {"max_steps": steps},
        "checkpoint": {"every_steps": steps, "keep": 1},
        "evaluation": {"eval_every": 0, "max_generate_examples": 16},
    }


def run(root: Path, document: dict, devices: int) -> dict:
    path = root / f"{document['job_id']}.json"
    path.write_text(json.dumps(document, indent=2))
    out = root / "out"
    flags = f"--xla_force_host_platform_device_count={devices}" if devices > 1 else ""
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": flags}
    command = [sys.executable, "-m", "minifield.worker", "--job", str(path)]
    command += ["--input-root", str(root / "in"), "--output-root", str(out)]
    proc = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        sys.exit(f"worker ({devices} device(s)) exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    (attempt,) = sorted((out / document["job_id"]).iterdir())
    events = [json.loads(line) for line in (attempt / "events.jsonl").read_text().splitlines()]
    updates = [e for e in events if e["type"] == "update"]
    result = json.loads((attempt / "result.json").read_text())
    return {
        "loss": np.array([e["loss"] for e in updates]),
        "seconds": float(np.median([e["seconds"] for e in updates])),
        "placement": next(e for e in events if e["type"] == "compiled")["placement"],
        "final_state_hash": result["final_state_hash"],
        "dev_loss": result["metrics"]["dev_loss"],
    }


def plot(path: Path, one: dict, many: dict, devices: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = np.arange(1, len(one["loss"]) + 1)
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 6), sharex=True)
    top.plot(steps, one["loss"], label="1 device", linewidth=2)
    top.plot(steps, many["loss"], "--", label=f"{devices} devices (forced host)", linewidth=2)
    top.set_ylabel("training loss")
    top.legend()
    relative = np.abs(one["loss"] - many["loss"]) / np.abs(one["loss"])
    bottom.semilogy(steps, np.maximum(relative, 1e-9), "o-", label="relative difference")
    bottom.axhline(TOLERANCE, color="red", linestyle=":", label=f"tolerance {TOLERANCE:g}")
    bottom.set_xlabel("update")
    bottom.set_ylabel("|Δloss| / loss")
    bottom.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--devices", type=int, default=4)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--shard-params", action="store_true")
    parser.add_argument("--png", type=Path, help="also write the two curves as a PNG")
    parser.add_argument("--work", type=Path, help="keep the runs here (default: a temp dir)")
    args = parser.parse_args()
    from minifield.supervision import accelerator

    # only a worker opens the accelerator: this parent runs JAX on the CPU, if at all
    # (minifield.supervision.accelerator); the processes it measures get worker_env
    accelerator.keep_off()
    if 16 % args.devices:
        parser.error("--devices must divide the batch size 16")

    with tempfile.TemporaryDirectory() as tmp:
        root = args.work or Path(tmp)
        root.mkdir(parents=True, exist_ok=True)
        pins = write_data(root)
        one = run(root, recipe(pins, 1, args.steps, False), 1)
        many = run(root, recipe(pins, args.devices, args.steps, args.shard_params), args.devices)

    n = args.devices
    absolute = np.abs(one["loss"] - many["loss"])
    relative = absolute / np.abs(one["loss"])
    print(
        f"packed-sft, d_model 64, 2 layers, seq_len 64, batch 16 ({16 // n} rows per device "
        f"on {n}), {args.steps} updates, BF16 compute; placement: {many['placement']}"
    )
    print(
        f"{'update':>6} {'loss 1 device':>15} {f'loss {n} devices':>15} {'abs diff':>10} {'rel diff':>10}"
    )
    for step, (a, b, d, r) in enumerate(
        zip(one["loss"], many["loss"], absolute, relative, strict=True), 1
    ):
        print(f"{step:>6} {a:>15.7f} {b:>15.7f} {d:>10.2e} {r:>10.2e}")
    print(f"max abs difference {absolute.max():.3e}, max rel difference {relative.max():.3e}")
    print(
        f"tolerance (relative) {TOLERANCE:g}: {'within' if relative.max() <= TOLERANCE else 'EXCEEDED'}"
    )
    print(f"final DEV loss: 1 device {one['dev_loss']:.7f}, {n} devices {many['dev_loss']:.7f}")
    print(f"final state hash 1 device  {one['final_state_hash']}")
    print(f"final state hash {n} devices {many['final_state_hash']}")
    print(
        f"median update seconds: 1 device {one['seconds'] * 1e3:.1f} ms, {n} simulated devices "
        f"{many['seconds'] * 1e3:.1f} ms (shared CPU cores; not an accelerator speed-up)"
    )
    if args.png:
        plot(args.png, one, many, n)
        print(f"wrote {args.png}")
    return 0 if relative.max() <= TOLERANCE else 1


if __name__ == "__main__":
    sys.exit(main())
