"""Checkpoint commits and per-update state hashing, against baselines measured in the same run.

For the complete training state (parameters + AdamW moments + RNG, step, cursor) of a real
packed-sft model (``init_train_state``), on this machine's disk, round by round:

- **raw**: the same bytes written as one file + fsync + rename + directory fsync: the
  machine's fsync write bandwidth, the ceiling for any durable commit;
- **previous commit**: the commit as it was before (a ``.npy`` serialised in memory, sha256
  of it, write + fsync per array, the whole state hashed again) — a copy kept here as the
  reference point;
- **synchronous commit**: :func:`minifield.state.checkpoint.save` (each file hashed while it is
  written, fsyncs overlapping the writes, the state hash computed alongside), also with the
  state hash already known (what a checkpoint at a hashed update gets), and its CPU time
  (``sync_cpu``: the hashing and copying that a busy machine has to find cores for);
- **asynchronous commit**: :class:`minifield.attempt.checkpoint_cadence.Checkpointing` with its
  background writer: the time the update loop is blocked at the step boundary (the host
  copy, handing it over), then the wait for durability.

Printed ratios: synchronous bandwidth ÷ raw (goal ≥ 0.8), blocking ÷ synchronous commit time
(goal ≤ 0.15), and previous ÷ synchronous time. Then the per-update state-hashing cost at two
model sizes (what ``train.state_hash_every: 1`` adds to an update: the host copy, the
complete-state hash and the part hashes) next to that model's update time.

Usage: uv run python benchmarks/checkpoint_commit.py [--rounds 5] [--dir DIR] [--json OUT]
(``--dir`` must be on the disk checkpoints go to; the default is under ``work/``).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import jax
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_train import TRAINING, VOCAB, packed_batch  # noqa: E402

from minifield import atomic  # noqa: E402
from minifield.attempt.checkpoint_cadence import Checkpointing  # noqa: E402
from minifield.attempt.events import EventLog  # noqa: E402
from minifield.attempt.faults import Faults  # noqa: E402
from minifield.attempt.update_loop import HostSnapshot  # noqa: E402
from minifield.digest import sha256_bytes  # noqa: E402
from minifield.state import checkpoint  # noqa: E402
from minifield.state.arrays import hash_named_arrays, named_arrays  # noqa: E402
from minifield.strategies.packed_sft.model import ModelConfig  # noqa: E402
from minifield.strategies.packed_sft.optimizer import make_optimizer  # noqa: E402
from minifield.strategies.packed_sft.sft_step import (  # noqa: E402
    init_train_state,
    make_train_step,
)
from minifield.supervision import distributed  # noqa: E402

#: (d_model, layers): the checkpoint state (≥ 100 MB) and the two hashing sizes
CHECKPOINT_SIZE = (384, 6)
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


def previous_commit(directory: Path, state, step: int) -> float:
    """The commit before this benchmark's change, kept as the reference point."""
    started = time.perf_counter()
    final = directory / checkpoint.step_dir_name(step)
    tmp = directory / f".tmp-prev-{step}"
    (tmp / "arrays").mkdir(parents=True)
    arrays = named_arrays(state)
    entries = []
    for index, (name, array) in enumerate(sorted(arrays.items())):
        buffer = io.BytesIO()
        np.save(buffer, np.asarray(array, order="C"), allow_pickle=False)
        data = buffer.getvalue()
        with open(tmp / f"arrays/{index:05d}.npy", "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        entries.append({"name": name, "sha256": sha256_bytes(data)})
    manifest = {"arrays": entries, "state_hash": hash_named_arrays(sorted(arrays.items()))}
    atomic.fsync_dir(tmp / "arrays")
    atomic.write_json(tmp / "manifest.json", manifest)
    os.rename(tmp, final)
    atomic.fsync_dir(directory)
    seconds = time.perf_counter() - started
    shutil.rmtree(final)
    return seconds


def sync_commit(directory: Path, state, step: int, known_hash: str | None = None):
    """(wall seconds, CPU seconds of this process) of one synchronous commit."""
    started, cpu = time.perf_counter(), time.process_time()
    checkpoint.save(
        directory, state, step=step, computation_digest="bench", keep=1, known_state_hash=known_hash
    )
    return time.perf_counter() - started, time.process_time() - cpu


def async_commit(directory: Path, state, step: int) -> tuple[float, float]:
    """(seconds the loop was blocked, seconds until the commit was durable)."""
    checkpoints = Checkpointing(
        directory,
        computation_digest="bench",
        attempt_id="bench",
        every_steps=1,
        max_steps=10**9,
        keep=1,
        group=distributed.Group(),
        events=EventLog(None, None),
        faults=Faults(),
    )
    started = time.perf_counter()
    checkpoints.on_cadence(state, step, 0.0)
    blocked = time.perf_counter() - started
    checkpoints.wait()
    durable = time.perf_counter() - started
    assert checkpoints.newest is not None and checkpoints.newest.step == step
    return blocked, durable


def hashing_cost(d_model: int, layers: int, rounds: int) -> dict:
    """One hashed update's extra cost (host copy + complete-state hash + part hashes, as the
    update loop does it) next to that model's update time."""
    cfg, tx, state = _state(d_model, layers)
    step = jax.jit(make_train_step(cfg, tx), donate_argnums=(0,))
    batch = packed_batch(BATCH, SEQ)
    state, _ = step(state, batch)  # compile
    jax.block_until_ready(state)
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--dir", type=Path, default=Path("work"))
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    args.dir.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="bench-checkpoint-", dir=args.dir))
    try:
        _, _, state = _state(*CHECKPOINT_SIZE)
        jax.block_until_ready(state)
        nbytes = _nbytes(state)
        data = b"".join(np.ascontiguousarray(a).tobytes() for a in named_arrays(state).values())
        rows = {
            "raw": [],
            "previous": [],
            "sync": [],
            "sync_cpu": [],
            "sync_hash_known": [],
            "blocked": [],
            "async_durable": [],
        }
        # what the update loop passes at a checkpoint whose update was hashed on the cadence
        known = hash_named_arrays(sorted(named_arrays(state).items()))
        step = 0
        for _ in range(args.rounds):  # interleaved, so every ratio comes from the same window
            rows["raw"].append(raw_commit(work, data))
            step += 1
            rows["previous"].append(previous_commit(work / "prev", state, step))
            wall, cpu = sync_commit(work / "sync", state, step)
            rows["sync"].append(wall)
            rows["sync_cpu"].append(cpu)
            rows["sync_hash_known"].append(sync_commit(work / "known", state, step, known)[0])
            blocked, durable = async_commit(work / "async", state, step)
            rows["blocked"].append(blocked)
            rows["async_durable"].append(durable)
        med = {k: statistics.median(v) for k, v in rows.items()}
        result = {
            "state_mb": nbytes / 1e6,
            "rounds": args.rounds,
            "median_ms": {k: v * 1e3 for k, v in med.items()},
            "raw_fsync_mb_s": nbytes / med["raw"] / 1e6,
            "sync_commit_mb_s": nbytes / med["sync"] / 1e6,
            "sync_over_raw_bandwidth": med["raw"] / med["sync"],
            "sync_hash_known_over_raw_bandwidth": med["raw"] / med["sync_hash_known"],
            "previous_over_sync_time": med["previous"] / med["sync"],
            "blocking_over_sync_time": med["blocked"] / med["sync"],
            "hashing": [hashing_cost(d, n, args.rounds) for d, n in HASH_SIZES],
        }
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"state {result['state_mb']:.1f} MB, median of {args.rounds} rounds")
    for name, ms in result["median_ms"].items():
        print(f"  {name:14s} {ms:8.1f} ms")
    print(
        f"raw fsync write {result['raw_fsync_mb_s']:.0f} MB/s; synchronous commit "
        f"{result['sync_commit_mb_s']:.0f} MB/s = {result['sync_over_raw_bandwidth']:.2f} of raw "
        f"(goal >= 0.8); with the state hash known (hashed update): "
        f"{result['sync_hash_known_over_raw_bandwidth']:.2f} of raw; previous commit took "
        f"{result['previous_over_sync_time']:.2f}x as long"
    )
    print(
        f"asynchronous: blocked {result['median_ms']['blocked']:.1f} ms = "
        f"{result['blocking_over_sync_time']:.3f} of the synchronous commit (goal <= 0.15)"
    )
    for row in result["hashing"]:
        print(
            f"hash per update, {row['model']} ({row['state_mb']:.1f} MB state): "
            f"{row['hash_ms']:.1f} ms vs update {row['update_ms']:.1f} ms "
            f"(+{row['hash_over_update'] * 100:.0f} %)"
        )
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
