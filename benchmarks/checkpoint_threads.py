"""Where a one-process commit's time goes: the device check's 125M state (1.52 GB, 41 arrays)
committed from host arrays, the disk emulated, each thread's CPU measured.

The writes are emulated (``--bandwidth``, default 700 MB/s, the chip host's raw write+fsync
in docs/tpu.md): each gathered write sleeps its bytes ÷ the bandwidth, without the GIL as a
write to a disk would; ``fsync`` is free. So the commit's own work (hashing, the threads'
turns at the GIL, the writer's waits for it) is measured apart from this machine's disk and
page cache (a microVM's, whose writes to fresh pages wait on its host: wall times there vary
fourfold). Per round: the commit's wall time and process CPU, when the writer finished its
writes (``writer_done_s``: the emulated floor is bytes ÷ bandwidth) and how long it then waited
for the digests (``hash_tail_s``), each thread's CPU in ``pieces.array_digest`` (the writing
thread's, the one thread beside the pool, the pool's threads), and the process's voluntary
context switches (each a thread waiting, mostly for the GIL). The checkpoint's state hash and
manifest sha256 are printed, to compare with another release's (they must not change).

Usage: uv run python benchmarks/checkpoint_threads.py [--rounds 3] [--bandwidth 700e6]
(before/after: run it once with ``PYTHONPATH=<other checkout>/src`` too).
"""

from __future__ import annotations

import argparse
import collections
import json
import resource
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent / "device_check"))

import jax  # noqa: E402

from minifield.state import checkpoint, checkpoint_data, pieces  # noqa: E402


def state_125m():
    """The device check's 125M training state (parameters and both AdamW moments in FP32)."""
    from device_check.cli import parse_args
    from device_check.settings import MAX_STEPS, execution, llama_config, model_shape, seq_len

    from minifield.training.optimizer import make_optimizer
    from minifield.training.train_step import init_train_state

    args = parse_args(["--backend", "cpu"])
    cfg = llama_config(model_shape(args, "125m"), seq_len(args), execution(args))
    optimizer = make_optimizer({}, MAX_STEPS)
    state = jax.jit(lambda: init_train_state(cfg, optimizer, seed=0))()
    return jax.block_until_ready(state)


class Probe:
    """The emulated disk, and the times and per-thread CPU of one commit."""

    def __init__(self, bandwidth: float) -> None:
        self.bandwidth = bandwidth
        self.cpu: dict[str, float] = collections.defaultdict(float)
        self.marks: dict[str, float] = {}
        self.digest, self.results = pieces.array_digest, checkpoint_data._Digests.results

    def install(self) -> None:
        probe = self

        def write_all(fd, buffers):  # a disk's write: no CPU, no GIL
            time.sleep(sum(memoryview(b).nbytes for b in buffers) / probe.bandwidth)

        def digest(array):
            started = time.thread_time()
            try:
                return probe.digest(array)
            finally:
                probe.cpu[threading.current_thread().name] += time.thread_time() - started

        def results(self):
            probe.marks["writer_done"] = time.perf_counter()
            return probe.results(self)

        checkpoint_data._write_all = write_all
        checkpoint_data.os.fsync = lambda fd: None  # this process writes nothing (above)
        pieces.array_digest = digest
        checkpoint_data._Digests.results = results


def one_commit(probe: Probe, directory: Path, state, step: int) -> dict:
    probe.cpu.clear()
    before = resource.getrusage(resource.RUSAGE_SELF)
    started = time.perf_counter()
    record = checkpoint.save(directory, state, step=step, computation_digest="bench", keep=1)
    wall = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_SELF)
    threads = {name: round(cpu, 3) for name, cpu in sorted(probe.cpu.items())}
    return {
        "wall_s": wall,
        "cpu_s": after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime,
        "writer_done_s": probe.marks["writer_done"] - started,
        "hash_tail_s": started + wall - probe.marks["writer_done"],
        "voluntary_switches": after.ru_nvcsw - before.ru_nvcsw,
        "digest_cpu_by_thread": threads,
        "state_hash": record.state_hash,
        "manifest_sha256": record.sha256,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--bandwidth", type=float, default=700e6, help="emulated bytes/s")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    state = state_125m()
    nbytes = sum(leaf.nbytes for leaf in jax.tree.leaves(state))
    probe = Probe(args.bandwidth)
    probe.install()
    directory = Path(tempfile.mkdtemp(prefix="checkpoint-threads-"))
    try:
        rounds = [one_commit(probe, directory, state, k) for k in range(1, args.rounds + 1)]
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    keys = ("wall_s", "cpu_s", "writer_done_s", "hash_tail_s", "voluntary_switches")
    out = {
        "code": str(Path(checkpoint.__file__).parent),
        "state_bytes": nbytes,
        "floor_s": nbytes / args.bandwidth,
        "median": {k: statistics.median(r[k] for r in rounds) for k in keys},
        "rounds": rounds,
    }
    print(json.dumps(out, indent=1))
    if args.json:
        args.json.write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
