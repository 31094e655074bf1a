"""Delivery to MLflow: throughput (events/s) and the training step-time overhead of live delivery.

Starts a local ``mlflow server`` (SQLite backend, temporary directory; the ``tracking-server``
test group), then, in the same run:

1. **throughput**: delivers a pre-made events file of ``--events`` update events (worker-shaped:
   loss, learning rate, seconds, examples, tokens) with the exactly-once protocol, in this
   process; prints events/s and metric points/s;
2. **overhead**: runs the same real worker attempt (``--recipe``, ``--stop-after-step
   --steps``) under the supervisor with live delivery **off** and **on**, alternating,
   ``--rounds`` times each, and compares the median update time (the events' ``seconds``) and
   the wall time from the first to the last update. Goal: at most 2 % slower with delivery on.

    uv run --locked python benchmarks/tracking_delivery.py [--events 5000] [--steps 60] [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from minifield.pipeline import preparation
from minifield.supervision import supervise
from minifield.tracking import connection, delivery, live, settings


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _start_server(root: Path) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    command = [str(Path(sys.executable).parent / "mlflow"), "server", "--host", "127.0.0.1",
               "--port", str(port), "--workers", "1",
               "--backend-store-uri", f"sqlite:///{root / 'mlflow.db'}",
               "--artifacts-destination", str(root / "artifacts")]  # fmt: skip
    log = open(root / "server.log", "wb")
    # No background job runner (workers for MLflow's own scheduled jobs): not used here.
    quiet = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    process = subprocess.Popen(command, stdout=log, stderr=log, start_new_session=True, env=quiet)
    uri = f"http://127.0.0.1:{port}"
    for _ in range(1200):
        try:
            with urllib.request.urlopen(f"{uri}/health", timeout=2):
                return process, uri
        except OSError:
            time.sleep(0.5)
    raise SystemExit("mlflow server did not start; see " + str(root / "server.log"))


def _premade(root: Path, count: int) -> Path:
    attempt = root / "premade" / "job" / "a-bench"
    attempt.mkdir(parents=True)
    (attempt / "attempt.json").write_text(json.dumps({
        "attempt_id": "a-bench", "job_id": "bench", "computation_digest": "b" * 64,
        "environment": {}, "started": "2026-01-01T00:00:00+00:00"}))  # fmt: skip
    with open(attempt / "events.jsonl", "w") as handle:
        for step in range(1, count + 1):
            event = {"seq": step - 1, "time": 1.8e9 + step, "mono": float(step), "type": "update",
                     "step": step, "loss": 1.0 / step, "learning_rate": 1e-3, "seconds": 0.05,
                     "examples": 8, "tokens": 256}  # fmt: skip
            handle.write(json.dumps(event) + "\n")
    return attempt


def _updates(attempt: Path) -> tuple[list[float], float]:
    events = [json.loads(line) for line in (attempt / "events.jsonl").read_text().splitlines()]
    updates = [e for e in events if e["type"] == "update"]
    return [e["seconds"] for e in updates[1:]], updates[-1]["mono"] - updates[0]["mono"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=5000)
    parser.add_argument("--recipe", type=Path, default=Path("config/recipes/sft-demo.yaml"))
    parser.add_argument("--input-root", type=Path, default=Path("data"))
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    from minifield.supervision import accelerator

    # only a worker opens the accelerator: this parent runs JAX on the CPU, if at all
    # (minifield.supervision.accelerator); the processes it measures get worker_env
    accelerator.keep_off()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        started = time.monotonic()
        server, uri = _start_server(root)
        print(f"mlflow server up after {time.monotonic() - started:.1f} s at {uri}")
        try:
            chosen = settings.from_config(
                {
                    "tracking": {
                        "enabled": True,
                        "uri": uri,
                        "experiment": "bench",
                        "state_dir": str(root / "state"),
                    }
                }  # fmt: skip
            )
            link = delivery.Delivery(connection.Connection(chosen))
            attempt = _premade(root, args.events)
            began = time.perf_counter()
            link.deliver_attempt(attempt, batch_events=100)
            took = time.perf_counter() - began
            print(f"throughput: {args.events} update events ({args.events * 5} metric points) in "
                  f"{took:.2f} s = {args.events / took:.0f} events/s, "
                  f"{args.events * 5 / took:.0f} points/s (batches of 100 events)")  # fmt: skip

            preparation.validate(args.recipe, root / "recipe.json", root / "validation.json")
            preparation.prepare(root / "recipe.json", args.input_root, root / "examples")
            figures: dict[str, list] = {"off": [], "on": []}
            cpu_shares: list[float] = []
            for round_ in range(args.rounds):
                for mode in ("off", "on"):
                    name = f"a-{mode}-{round_}"
                    out = root / "out"
                    command = supervise.worker_command(
                        "--job", root / "recipe.json", "--input-root", args.input_root,
                        "--output-root", out, "--examples", root / "examples",
                        "--attempt-id", name, "--stop-after-step", str(args.steps),
                        "--compilation-cache", root / "jax-cache",
                    )  # fmt: skip
                    job = json.loads((root / "recipe.json").read_text())["job_id"]
                    companion = (
                        live.LiveDelivery(chosen, out / job / name, log_path=root / f"{name}.log")
                        if mode == "on"
                        else None
                    )
                    cpu_before = resource.getrusage(resource.RUSAGE_CHILDREN)
                    outcome = supervise.supervise(
                        command, root / "runs" / name,
                        supervise.Settings(forward_signals=False), companion=companion,
                    )  # fmt: skip
                    cpu_after = resource.getrusage(resource.RUSAGE_CHILDREN)
                    cpu = (cpu_after.ru_utime - cpu_before.ru_utime) + (
                        cpu_after.ru_stime - cpu_before.ru_stime
                    )
                    follower_cpu = outcome["companion"]["cpu_s"] if companion else 0.0
                    worker_cpu = cpu - follower_cpu
                    seconds, wall = _updates(out / job / name)
                    figures[mode].append((statistics.median(seconds), wall))
                    if companion:
                        cpu_shares.append(follower_cpu / worker_cpu)
                        print(f"      CPU: worker {worker_cpu:.2f} s, delivery follower "
                              f"{follower_cpu:.2f} s = {follower_cpu / worker_cpu:.1%}")  # fmt: skip
                    print(f"  {mode:>3} round {round_}: {outcome['classification']}, median update "
                          f"{statistics.median(seconds) * 1e3:.2f} ms, updates 1..{args.steps} "
                          f"wall {wall:.2f} s"
                          + (f", delivery {outcome['companion']}" if companion else ""))  # fmt: skip
            off = statistics.median(m for m, _ in figures["off"])
            on = statistics.median(m for m, _ in figures["on"])
            off_wall = statistics.median(w for _, w in figures["off"])
            on_wall = statistics.median(w for _, w in figures["on"])
            print(f"overhead of live delivery: median update {on * 1e3:.2f} ms on vs "
                  f"{off * 1e3:.2f} ms off = {on / off:.3f}x; update wall {on_wall:.2f} s vs "
                  f"{off_wall:.2f} s = {on_wall / off_wall:.3f}x (goal <= 1.02x)")  # fmt: skip
            print(f"delivery follower CPU / worker CPU: median {statistics.median(cpu_shares):.1%} "
                  "(the most it can take from training on a saturated machine)")  # fmt: skip
            before = resource.getrusage(resource.RUSAGE_CHILDREN)
            subprocess.run([sys.executable, "-c", "from mlflow import MlflowClient"], check=True)
            after = resource.getrusage(resource.RUSAGE_CHILDREN)
            start_up = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
            print(f"of which a fixed start-up cost per attempt: importing the MLflow client takes "
                  f"{start_up:.2f} s CPU in a fresh process")  # fmt: skip
        finally:
            os.killpg(server.pid, signal.SIGTERM)
            server.wait(timeout=30)
    return 0


if __name__ == "__main__":
    sys.exit(main())
