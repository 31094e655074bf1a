"""Checkpoint commits, what they cost a running training loop, and per-update state hashing,
against a raw write+fsync of the same bytes measured in the same run.

For the complete training state (parameters + AdamW moments + RNG, step, cursor) of a real
packed-sft model (``init_train_state``), on this machine's disk, round by round:

- **raw**: the same bytes written as one file + fsync + rename + directory fsync: the
  machine's fsync write bandwidth, the ceiling for any durable commit;
- **two passes**: the commit plus the version-1 state hash — a second sha256 pass over every
  byte, what format 1 added — on another thread;
- **synchronous commit**: :func:`minifield.state.checkpoint.save` (format 5: one data file,
  each array's version-3 digest hashed once while it is written, the state hash the hash of
  those digests), also with the digests already known (a checkpoint at a hashed update: no
  hashing at all), and its CPU time;
- **asynchronous commit**: :class:`minifield.attempt.checkpoint_cadence.CheckpointCadence` with its
  background writer: the time the update loop is blocked at the step boundary, then the
  wait for durability.

**Cost to the loop** (a smaller model, ``LOOP_SIZE``, whose state is about 40 MB): the loop
runs ``LOOP_UPDATES`` real training updates (both cores busy) while a checkpoint taken at the
first one is written in the background, against the same updates with no checkpoint; the
difference (wall and process CPU) is what the checkpoint cost the loop, for the commit as
the loop does it (``CheckpointCadence``; at an update that was not hashed, and at a hashed
one — ``train.state_hash_every: 1``, the default — whose per-array hashes the update loop
computed for its ``update`` event anyway), the two-pass work, and a raw write in the
background. Printed: each cost ÷ one raw write+fsync of those bytes (goal ≤ 1.5 for the
commit).

**Each commit alone** (``commit_cpu``, the ``LOOP_SIZE`` state; ``--cpu-only`` runs only this):
its CPU and wall time, interleaved round by round with the raw write+fsync and with what was
the floor of a format-3 commit at a hashed update (``raw_and_sha256``: the raw write plus one
sha256 pass over the same bytes, that manifest's per-array hashes, which the version-3
digests the update computed did not give; format 5 records those digests instead).

Then the per-update state-hashing cost at two model sizes (what ``train.state_hash_every: 1``
adds to an update: the host copy, the per-array hashes, the whole and part hashes) next to
that model's update time.

Usage: uv run python benchmarks/checkpoint_commit.py [--rounds 5] [--cpu-only] [--dir DIR]
[--json OUT]
(``--dir`` must be on the disk checkpoints go to; the default is under ``work/``).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import jax
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_train import TRAINING, VOCAB, packed_batch  # noqa: E402

from minifield import atomic  # noqa: E402
from minifield.attempt.checkpoint_cadence import CheckpointCadence  # noqa: E402
from minifield.attempt.events import EventLog  # noqa: E402
from minifield.attempt.faults import Faults  # noqa: E402
from minifield.attempt.update_loop import HostSnapshot  # noqa: E402
from minifield.models.model import ModelConfig  # noqa: E402
from minifield.state import checkpoint  # noqa: E402
from minifield.state.arrays import (  # noqa: E402
    array_digests,
    hash_named_arrays,
    named_arrays,
)
from minifield.supervision import distributed  # noqa: E402
from minifield.training.optimizer import make_optimizer  # noqa: E402
from minifield.training.train_step import init_train_state, make_train_step

#: (d_model, layers): the checkpoint state (≥ 100 MB), the loop-cost state (≈ 40 MB) and the
#: two hashing sizes
CHECKPOINT_SIZE = (384, 6)
LOOP_SIZE, LOOP_UPDATES = (256, 4), 4
HASH_SIZES = [(128, 2), (384, 6)]
SEQ, BATCH = 128, 8


def _state(d_model: int, layers: int):
    cfg = ModelConfig(
        vocab_size=VOCAB,
        d_model=d_model,
        n_layers=layers,
        n_heads=4,
        d_ff=4 * d_model,
        max_len=SEQ,
        compute_dtype="float32",
    )
    tx = make_optimizer(TRAINING, 1000)
    return cfg, tx, init_train_state(cfg, tx, seed=0)


def _nbytes(state) -> int:
    return sum(a.nbytes for a in named_arrays(state).values())


def raw_commit(directory: Path, data: bytes) -> float:
    started = time.perf_counter()
    tmp, final = directory / "raw.tmp", directory / "raw.bin"
    with open(tmp, "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())
    os.rename(tmp, final)
    atomic.fsync_dir(directory)
    seconds = time.perf_counter() - started
    final.unlink()
    return seconds


def two_pass_commit(directory: Path, state, step: int) -> None:
    """Format 1's work: the commit's writes and per-file hashes, and the version-1 state hash
    (a second sha256 pass over every byte) on another thread at the same time."""
    second = threading.Thread(
        target=hash_named_arrays, args=(sorted(named_arrays(state).items()),), kwargs={"version": 1}
    )
    second.start()
    checkpoint.save(directory, state, step=step, computation_digest="bench", keep=1)
    second.join()


def sync_commit(directory: Path, state, step: int, known: dict | None = None):
    """(wall seconds, CPU seconds of this process) of one synchronous commit."""
    started, cpu = time.perf_counter(), time.process_time()
    checkpoint.save(
        directory, state, step=step, computation_digest="bench", keep=1, known_digests=known
    )
    return time.perf_counter() - started, time.process_time() - cpu


def _cadence(directory: Path, snapshot: HostSnapshot | None = None) -> CheckpointCadence:
    """Checkpoints as the update loop commits them: on the cadence, in the background
    (``snapshot``: the update loop's host copy, hashed when that update was)."""
    return CheckpointCadence(
        directory,
        computation_digest="bench",
        attempt_id="bench",
        every_steps=1,
        max_steps=10**9,
        keep=1,
        group=distributed.Group(),
        events=EventLog(None, None),
        faults=Faults(),
        snapshot=snapshot,
    )


def async_commit(directory: Path, state, step: int) -> tuple[float, float]:
    """(seconds the loop was blocked, seconds until the commit was durable)."""
    checkpoints = _cadence(directory)
    started = time.perf_counter()
    checkpoints.on_cadence(state, step, 0.0)
    blocked = time.perf_counter() - started
    checkpoints.wait()
    durable = time.perf_counter() - started
    assert checkpoints.newest is not None and checkpoints.newest.step == step
    return blocked, durable


def _compiled(d_model: int, layers: int):
    """(jitted update with the state donated, state after one update, batch)."""
    cfg, tx, state = _state(d_model, layers)
    step = jax.jit(make_train_step(cfg, tx), donate_argnums=(0,))
    batch = packed_batch(BATCH, SEQ)
    state, _ = step(state, batch)  # compile
    jax.block_until_ready(state)
    return step, state, batch


def _in_background(work, *args):
    """Start ``work(*args)`` on a thread; returns the function that waits for it."""
    thread = threading.Thread(target=work, args=args)
    thread.start()
    return thread.join


def loop_costs(directory: Path, rounds: int) -> dict:
    """What one checkpoint costs a training loop that keeps both cores busy: the wall and
    process-CPU seconds of ``LOOP_UPDATES`` updates while it is written in the background,
    minus those of the same updates without it (per round, then the median)."""
    step_fn, state, batch = _compiled(*LOOP_SIZE)
    data = b"".join(np.ascontiguousarray(a).tobytes() for a in named_arrays(state).values())
    counter = {"commit": 0, "two_pass": 0, "hashed": 0}
    hashed = HostSnapshot()

    def loop(state, background=None):
        started, cpu = time.perf_counter(), time.process_time()
        finish = background(state) if background else None
        for _ in range(LOOP_UPDATES):
            state, _ = step_fn(state, batch)
            jax.block_until_ready(state)
        if finish:
            finish()
        return (time.perf_counter() - started, time.process_time() - cpu), state

    def commit(state):  # as the update loop does it: host copy, background writer
        counter["commit"] += 1
        cadence = _cadence(directory / "loop-commit")
        cadence.on_cadence(state, counter["commit"], 0.0)
        return cadence.wait

    def commit_hashed_update(state):  # the update's hashes computed by the loop (not timed)
        cadence = _cadence(directory / "loop-hashed", hashed)
        cadence.on_cadence(state, counter["hashed"], 0.0)
        return cadence.wait

    def two_pass(state):
        counter["two_pass"] += 1
        arrays = named_arrays(state)
        return _in_background(two_pass_commit, directory / "loop-two", arrays, counter["two_pass"])

    variants = {
        "commit": commit,
        "commit_hashed_update": commit_hashed_update,
        "two_pass": two_pass,
        "raw_background": lambda s: _in_background(raw_commit, directory, data),
    }
    raw, raw_cpu, plain, costs = [], [], [], {name: [] for name in variants}
    cpu_costs = {name: [] for name in variants}
    for _ in range(rounds):
        cpu = time.process_time()
        raw.append(raw_commit(directory, data))
        raw_cpu.append(time.process_time() - cpu)
        (base, base_cpu), state = loop(state)
        plain.append(base)
        for name, background in variants.items():
            if name == "commit_hashed_update":
                counter["hashed"] += 1
                hashed.hashes_of(state, counter["hashed"])  # what the update event hashed
            (wall, cpu), state = loop(state, background)
            hashed.forget()
            costs[name].append(wall - base)
            cpu_costs[name].append(cpu - base_cpu)
    raw_s = statistics.median(raw)
    cost = {name: statistics.median(v) for name, v in costs.items()}
    return {
        "model": f"d{LOOP_SIZE[0]}/{LOOP_SIZE[1]} layers",
        "state_mb": len(data) / 1e6,
        "updates": LOOP_UPDATES,
        "raw_write_fsync_ms": raw_s * 1e3,
        "raw_write_fsync_cpu_ms": statistics.median(raw_cpu) * 1e3,
        "loop_ms": statistics.median(plain) * 1e3,
        "cost_ms": {name: v * 1e3 for name, v in cost.items()},
        "cost_cpu_ms": {name: statistics.median(v) * 1e3 for name, v in cpu_costs.items()},
        "cost_over_raw": {name: v / raw_s for name, v in cost.items()},
    }


def raw_and_sha256(directory: Path, data: bytes) -> None:
    """The floor of a commit that must hash its bytes once (a format-3 manifest's per-array
    sha256, which a hashed update's version-3 digests did not give; format 5 needs no such
    pass): one raw write+fsync and one sha256 pass over the same bytes."""
    raw_commit(directory, data)
    hashlib.sha256(data).digest()


def commit_cpu(directory: Path, rounds: int) -> dict:
    """CPU seconds (this process, all threads) and wall seconds of each commit of the
    ``LOOP_SIZE`` state done alone, interleaved round by round: the CPU is what it takes from a
    loop that keeps every core busy (the issue's "what a checkpoint costs training"), and far
    less sensitive to other load on the machine than the wall-clock difference
    ``loop_costs`` measures; each ratio is to the raw write+fsync of the same round's
    medians."""
    _, _, state = _state(*LOOP_SIZE)
    jax.block_until_ready(state)
    arrays = named_arrays(state)
    data = b"".join(np.ascontiguousarray(a).tobytes() for a in arrays.values())
    known = array_digests(arrays)
    variants = {
        "raw": lambda k: raw_commit(directory, data),
        "raw_and_sha256": lambda k: raw_and_sha256(directory, data),
        "two_pass": lambda k: two_pass_commit(directory / "cpu-two", arrays, k),
        "commit": lambda k: checkpoint.save(
            directory / "cpu-commit", arrays, step=k, computation_digest="bench", keep=1
        ),
        "commit_hash_known": lambda k: checkpoint.save(
            directory / "cpu-known", arrays, step=k, computation_digest="bench", keep=1,
            known_digests=known,
        ),
    }  # fmt: skip
    cpu = {name: [] for name in variants}
    wall = {name: [] for name in variants}
    for k in range(1, rounds + 1):
        for name, commit in variants.items():
            started, started_wall = time.process_time(), time.perf_counter()
            commit(k)
            cpu[name].append(time.process_time() - started)
            wall[name].append(time.perf_counter() - started_wall)
    med = {name: statistics.median(v) for name, v in cpu.items()}
    med_wall = {name: statistics.median(v) for name, v in wall.items()}
    return {
        "state_mb": len(data) / 1e6,
        "cpu_ms": {name: v * 1e3 for name, v in med.items()},
        "over_raw": {name: v / med["raw"] for name, v in med.items()},
        "wall_ms": {name: v * 1e3 for name, v in med_wall.items()},
        "wall_over_raw": {name: v / med_wall["raw"] for name, v in med_wall.items()},
    }


def hashing_cost(d_model: int, layers: int, rounds: int) -> dict:
    """One hashed update's extra cost (host copy + per-array hashes + whole and part hashes,
    as the update loop does it) next to that model's update time."""
    step, state, batch = _compiled(d_model, layers)
    update_s, hash_s = [], []
    for _ in range(rounds):
        started = time.perf_counter()
        state, metrics = step(state, batch)
        jax.block_until_ready(state)
        update_s.append(time.perf_counter() - started)
        started = time.perf_counter()
        snapshot = HostSnapshot()
        snapshot.hashes_of(state, 1)
        snapshot.forget()
        hash_s.append(time.perf_counter() - started)
    update, hashed = statistics.median(update_s), statistics.median(hash_s)
    return {
        "model": f"d{d_model}/{layers} layers",
        "state_mb": _nbytes(state) / 1e6,
        "update_ms": update * 1e3,
        "hash_ms": hashed * 1e3,
        "hash_over_update": hashed / update,
    }


def commit_times(work: Path, rounds: int) -> dict:
    """The commit variants on the ``CHECKPOINT_SIZE`` state, interleaved round by round (so
    every ratio comes from the same window), medians."""
    _, _, state = _state(*CHECKPOINT_SIZE)
    jax.block_until_ready(state)
    nbytes = _nbytes(state)
    data = b"".join(np.ascontiguousarray(a).tobytes() for a in named_arrays(state).values())
    names = ["raw", "two_pass", "sync", "sync_cpu", "sync_hash_known", "blocked", "async_durable"]
    rows = {name: [] for name in names}
    # what the update loop passes at a checkpoint whose update was hashed on the cadence
    known = array_digests(named_arrays(state))
    for step in range(1, rounds + 1):
        rows["raw"].append(raw_commit(work, data))
        started = time.perf_counter()
        two_pass_commit(work / "two", state, step)
        rows["two_pass"].append(time.perf_counter() - started)
        wall, cpu = sync_commit(work / "sync", state, step)
        rows["sync"].append(wall)
        rows["sync_cpu"].append(cpu)
        rows["sync_hash_known"].append(sync_commit(work / "known", state, step, known)[0])
        blocked, durable = async_commit(work / "async", state, step)
        rows["blocked"].append(blocked)
        rows["async_durable"].append(durable)
    med = {k: statistics.median(v) for k, v in rows.items()}
    return {
        "state_mb": nbytes / 1e6,
        "median_ms": {k: v * 1e3 for k, v in med.items()},
        "raw_fsync_mb_s": nbytes / med["raw"] / 1e6,
        "sync_commit_mb_s": nbytes / med["sync"] / 1e6,
        "sync_over_raw_bandwidth": med["raw"] / med["sync"],
        "sync_hash_known_over_raw_bandwidth": med["raw"] / med["sync_hash_known"],
        "two_pass_over_sync_time": med["two_pass"] / med["sync"],
        "blocking_over_sync_time": med["blocked"] / med["sync"],
    }


def report(result: dict) -> None:
    commits, loop = result["commits"], result["loop"]
    print(f"state {commits['state_mb']:.1f} MB, median of {result['rounds']} rounds")
    for name, ms in commits["median_ms"].items():
        print(f"  {name:16s} {ms:8.1f} ms")
    print(
        f"raw fsync write {commits['raw_fsync_mb_s']:.0f} MB/s; synchronous commit "
        f"{commits['sync_commit_mb_s']:.0f} MB/s = {commits['sync_over_raw_bandwidth']:.2f} of "
        f"raw; with the array hashes known (hashed update): "
        f"{commits['sync_hash_known_over_raw_bandwidth']:.2f} of raw; the two-pass work took "
        f"{commits['two_pass_over_sync_time']:.2f}x as long; asynchronous: blocked "
        f"{commits['median_ms']['blocked']:.1f} ms = {commits['blocking_over_sync_time']:.3f} "
        f"of the synchronous commit"
    )
    print(
        f"cost to the loop, {loop['model']} ({loop['state_mb']:.1f} MB state, "
        f"{loop['updates']} updates = {loop['loop_ms']:.0f} ms): raw write+fsync "
        f"{loop['raw_write_fsync_ms']:.1f} ms ({loop['raw_write_fsync_cpu_ms']:.1f} ms CPU)"
    )
    for name, ms in loop["cost_ms"].items():
        print(
            f"  {name:16s} +{ms:6.1f} ms wall (+{loop['cost_cpu_ms'][name]:6.1f} ms CPU) = "
            f"{loop['cost_over_raw'][name]:.2f}x the raw write+fsync"
            + (" (goal <= 1.5)" if name.startswith("commit") else "")
        )
    for row in result["hashing"]:
        print(
            f"hash per update, {row['model']} ({row['state_mb']:.1f} MB state): "
            f"{row['hash_ms']:.1f} ms vs update {row['update_ms']:.1f} ms "
            f"(+{row['hash_over_update'] * 100:.0f} %)"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--dir", type=Path, default=Path("work"))
    parser.add_argument("--json", type=Path)
    parser.add_argument(
        "--cpu-only", action="store_true", help="only the commits' CPU time (commit_cpu)"
    )
    args = parser.parse_args()
    args.dir.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="bench-checkpoint-", dir=args.dir))
    try:
        cpu = commit_cpu(work, args.rounds)
        print(f"each commit of the {LOOP_SIZE} state ({cpu['state_mb']:.1f} MB) alone:")
        for name, ms in cpu["cpu_ms"].items():
            print(
                f"  {name:18s} CPU {ms:6.1f} ms ({cpu['over_raw'][name]:.2f}x raw), "
                f"wall {cpu['wall_ms'][name]:6.1f} ms ({cpu['wall_over_raw'][name]:.2f}x raw)"
            )
        if args.cpu_only:
            if args.json:
                args.json.write_text(json.dumps({"commit_cpu": cpu}, indent=2) + "\n")
            return
        result = {
            "commit_cpu": cpu,
            "rounds": args.rounds,
            "commits": commit_times(work, args.rounds),
            "loop": loop_costs(work, args.rounds),
            "hashing": [hashing_cost(d, n, args.rounds) for d, n in HASH_SIZES],
        }
    finally:
        shutil.rmtree(work, ignore_errors=True)
    report(result)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
