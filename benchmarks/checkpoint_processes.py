"""Checkpoints of a state spread over processes: memory and throughput per process, and
minifield's own per-process writer against Orbax's.

A state of ``--mb`` MiB (16 float32 arrays of 1024 columns sharded along their rows over 4
CPU devices in all, and one replicated scalar) is saved, then restored in fresh processes,
by 4 processes × 1 device joined on 127.0.0.1 and by 1 process × 4 devices, with each
writer (``benchmarks/_checkpoint_process.py`` is one process). Printed per run:

- **save peak / share**: each process's largest resident set size during the save, less
  its RSS with the state resident, over its share of the state (the bytes its devices hold);
- **restore peak / share**: the same during a restore into the state's layout, from the RSS
  of the fresh process before it (in brackets for minifield: the peak once the state is
  placed, before the state hash of a sliced restore is checked);
- **throughput**: bytes of the state over the slowest process's save (barrier to barrier),
  and its ratio to one process writing the same bytes with ``write`` + ``fsync`` to a file
  in the same directory (measured first, in this process).

The restore reads files just written (the page cache holds them): a disk-speed restore is
not measured. Usage: uv run python benchmarks/checkpoint_processes.py [--mb 1024]
[--writers minifield orbax] [--work DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).parent


def raw_write(directory: Path, nbytes: int) -> float:
    """Seconds one process takes to write ``nbytes`` to a new file and fsync it."""
    data = np.random.default_rng(0).integers(0, 255, nbytes, np.uint8)
    path = directory / "raw.bin"
    started = time.monotonic()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        view = memoryview(data)
        for start in range(0, nbytes, 4 << 20):
            os.write(fd, view[start : start + (4 << 20)])
        os.fsync(fd)
    finally:
        os.close(fd)
    seconds = time.monotonic() - started
    path.unlink()
    return seconds


def run(count: int, phase: str, writer: str, directory: Path, mb: int) -> list[dict]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    procs = []
    for rank in range(count):
        env = {
            **os.environ,
            "JAX_PLATFORMS": "cpu",
            "XLA_FLAGS": f"--xla_force_host_platform_device_count={4 // count}",
        }
        if count > 1:
            env.update(
                MINIFIELD_COORDINATOR=f"127.0.0.1:{port}",
                MINIFIELD_NUM_PROCESSES=str(count),
                MINIFIELD_PROCESS_ID=str(rank),
            )
        command = [sys.executable, str(HERE / "_checkpoint_process.py"), phase]
        command += ["--writer", writer, "--dir", str(directory), "--mb", str(mb)]
        procs.append(
            subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
        )
    reports = []
    for proc in procs:
        out, err = proc.communicate(timeout=1800)
        if proc.returncode != 0:
            raise SystemExit(f"{writer} {phase} failed:\n{err.decode()[-3000:]}")
        lines = [line for line in out.decode().splitlines() if line.startswith("{")]
        reports.append(json.loads(lines[-1]))
    return reports


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mb", type=int, default=1024)
    parser.add_argument("--writers", nargs="+", default=["minifield", "orbax"])
    parser.add_argument("--work")
    args = parser.parse_args()
    from minifield.supervision import accelerator

    # only a worker opens the accelerator: this parent runs JAX on the CPU, if at all
    # (minifield.supervision.accelerator); the processes it measures get worker_env
    accelerator.keep_off()
    work = Path(args.work or tempfile.mkdtemp(prefix="checkpoint-processes-"))
    work.mkdir(parents=True, exist_ok=True)
    nbytes = args.mb << 20
    raw = raw_write(work, nbytes)
    print(f"state {args.mb} MiB; one process write+fsync of its bytes: {raw:.2f} s "
          f"({nbytes / raw / 2**20:.0f} MiB/s)")  # fmt: skip
    print("| writer | processes | save peak / share (per process) | restore peak / share | "
          "save s | save MiB/s | ÷ raw write | restore s | hashes equal |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|")
    for writer in args.writers:
        for count in (4, 1):
            directory = work / f"{writer}-{count}"
            shutil.rmtree(directory, ignore_errors=True)
            saved = run(count, "save", writer, directory, args.mb)
            restored = run(count, "restore", writer, directory, args.mb)
            save_ratio = [(r["peak"] - r["baseline"]) / r["share_bytes"] for r in saved]
            restore_ratio = [(r["peak"] - r["baseline"]) / r["share_bytes"] for r in restored]
            placed = [r.get("peak_placed") for r in restored]
            placed_ratio = [
                (p - r["baseline"]) / r["share_bytes"]
                for p, r in zip(placed, restored, strict=True)
                if p is not None
            ]
            save_s = max(r["seconds"] for r in saved)
            restore_s = max(r["seconds"] for r in restored)
            hashes = {r["state_hash"] for r in saved + restored}
            print(
                f"| {writer} | {count} | {' '.join(f'{x:.2f}' for x in save_ratio)} | "
                f"{' '.join(f'{x:.2f}' for x in restore_ratio)}"
                f"{' (placed: ' + ' '.join(f'{x:.2f}' for x in placed_ratio) + ')' if placed_ratio else ''}"
                f" | {save_s:.2f} | "
                f"{nbytes / save_s / 2**20:.0f} | {raw / save_s:.2f} | {restore_s:.2f} | "
                f"{len(hashes) == 1} |",
                flush=True,
            )
            shutil.rmtree(directory, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
