"""Two processes vs one process over the same two-device mesh: bits and costs.

Runs the real worker on CPU for one small packed-sft recipe with
``training.data_parallel.devices: 2``:

- baseline: one process with two forced host devices
  (``XLA_FLAGS=--xla_force_host_platform_device_count=2``);
- two processes with one device each, joined through ``MINIFIELD_COORDINATOR`` on
  127.0.0.1 (gloo CPU collectives), as ``srun -n 2 minifield-worker --distributed`` runs.

Prints, for each: whole-process wall time, median update and checkpoint seconds (from the
events), and whether every per-update complete-state hash and the final one agree. Then the
ratios two-process / one-process. Both share this machine's CPU cores, so the ratios are the
*overhead* of cross-process collectives and coordination, not a multi-host speed-up.

Usage: uv run python benchmarks/multi_process.py [--steps 30] [--shard-params] [--work DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from data_parallel import recipe, write_data


def _attempt(out: Path, job_id: str) -> Path:
    (attempt,) = sorted((out / job_id).iterdir())
    return attempt


def _figures(attempt: Path, wall: float) -> dict:
    events = [json.loads(line) for line in (attempt / "events.jsonl").read_text().splitlines()]
    updates = [e for e in events if e["type"] == "update"]
    commits = [e for e in events if e["type"] == "checkpoint_committed"]
    return {
        "wall": wall,
        "update_seconds": float(np.median([e["seconds"] for e in updates])),
        "checkpoint_seconds": float(np.median([e["seconds"] for e in commits])),
        "hashes": [e["state_hash"] for e in updates],
        "final_state_hash": json.loads((attempt / "result.json").read_text())["final_state_hash"],
    }


def _command(path: Path, root: Path, out: Path, *extra: str) -> list[str]:
    return [
        sys.executable, "-m", "minifield.worker", "--job", str(path),
        "--input-root", str(root / "in"), "--output-root", str(out),
        "--record-state-hashes", *extra,
    ]  # fmt: skip


def one_process(root: Path, path: Path, job_id: str) -> dict:
    out = root / "one"
    env = {
        **os.environ,
        "JAX_PLATFORMS": "cpu",
        "XLA_FLAGS": "--xla_force_host_platform_device_count=2",
    }
    started = time.monotonic()
    proc = subprocess.run(_command(path, root, out), env=env, capture_output=True, text=True)
    wall = time.monotonic() - started
    if proc.returncode != 0:
        sys.exit(f"one process exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    return _figures(_attempt(out, job_id), wall)


def two_processes(root: Path, path: Path, job_id: str) -> dict:
    out = root / "two"
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    started = time.monotonic()
    procs = []
    for rank in range(2):
        env = {
            **os.environ,
            "JAX_PLATFORMS": "cpu",
            "XLA_FLAGS": "",
            "MINIFIELD_COORDINATOR": f"127.0.0.1:{port}",
            "MINIFIELD_NUM_PROCESSES": "2",
            "MINIFIELD_PROCESS_ID": str(rank),
        }
        procs.append(
            subprocess.Popen(
                _command(path, root, out, "--distributed"),
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    errors = [p.communicate()[1] for p in procs]
    wall = time.monotonic() - started
    for rank, (p, err) in enumerate(zip(procs, errors, strict=True)):
        if p.returncode != 0:
            sys.exit(f"process {rank} exited {p.returncode}:\n{err[-3000:]}")
    return _figures(_attempt(out, job_id), wall)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--shard-params", action="store_true")
    parser.add_argument("--work", type=Path, help="keep the runs here (default: a temp dir)")
    args = parser.parse_args()
    from minifield.supervision import accelerator

    # only a worker opens the accelerator: this parent runs JAX on the CPU, if at all
    # (minifield.supervision.accelerator); the processes it measures get worker_env
    accelerator.keep_off()

    with tempfile.TemporaryDirectory() as tmp:
        root = args.work or Path(tmp)
        root.mkdir(parents=True, exist_ok=True)
        document = recipe(write_data(root), 2, args.steps, args.shard_params)
        document["checkpoint"]["every_steps"] = max(1, args.steps // 3)
        path = root / "recipe.json"
        path.write_text(json.dumps(document, indent=2))
        one = one_process(root, path, document["job_id"])
        two = two_processes(root, path, document["job_id"])

    same = one["hashes"] == two["hashes"] and one["final_state_hash"] == two["final_state_hash"]
    print(
        f"packed-sft, d_model 64, 2 layers, seq_len 64, batch 16 over a 2-device mesh "
        f"(shard_params={args.shard_params}), {args.steps} updates, CPU"
    )
    print(f"{'':>28} {'1 process, 2 devices':>22} {'2 processes, 1 device':>22} {'ratio':>7}")
    for label, key, scale, unit in (
        ("whole-process wall time", "wall", 1, "s"),
        ("median update", "update_seconds", 1e3, "ms"),
        ("median checkpoint commit", "checkpoint_seconds", 1e3, "ms"),
    ):
        a, b = one[key] * scale, two[key] * scale
        print(f"{label:>28} {a:>19.1f} {unit:<2} {b:>19.1f} {unit:<2} {b / a:>7.2f}")
    print(f"per-update state hashes ({len(one['hashes'])}) and final state hash identical: {same}")
    print(f"final state hash {two['final_state_hash']}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
