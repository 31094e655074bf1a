"""The ``checkpoint`` section: the 125M model's complete training state (1.52 GB: parameters and
both AdamW moments in FP32) committed from the device, against its two floors measured in the
same rounds.

Every measurement takes a fresh state made on the device (:func:`_fresh`: computed by a jitted
program, equal to the state), since JAX keeps an array's host copy once it has been fetched:
a commit of a state already read back times the hashing and the writes alone (15e5d9e's
3.19 s on the chip was such a figure). Per round, each on its own fresh state:

- floor (a), ``device_to_host_s``: the state's device→host copy alone (every array's
  ``copy_to_host_async`` started, then each awaited), as the commit starts it;
- floor (b), ``raw_s``: the same bytes written as one file + fsync + rename + directory fsync
  (the disk's bandwidth, the ceiling for any durable commit);
- ``sync_s``: ``checkpoint.save`` (copy, hash, write, fsync, manifest, rename), with its CPU;
- ``held_sync_s``: the same commit of a fresh state once its host copy is held (read back,
  ``read_back_s``): the commit without the copy, with its CPU (``checkpoint.save`` copies
  everything first, then hashes and writes: ``sync_s`` is about the two together);
- ``hot_sync_s``: that held copy committed once more (a host copy one commit has been
  through), and ``paused_sync_s``: a fresh state read back, then committed after
  :data:`PAUSE_S` seconds: on the chip a held copy one commit had been through committed in
  half the time of a fresh one (docs/tpu.md), and these tell whether it is the time since the
  copy or the copy's memory; ``touch_s`` and ``touched_sync_s``: a fresh state read back, one
  byte of every 4 KiB page of its host copy read on one thread (:func:`touch`), then
  committed: whether a first pass over the copy's pages is what the commit of a fresh copy
  pays for (at 60c4491 the pause did not help: the second commit of a copy alone was cheap);
- ``settled_sync_s``: the commit of a fresh read-back made :data:`SETTLE_S` seconds after the
  previous state and its host copy were let go (every other commit starts just after one
  was: whether freeing the last copy is what the commit pays for), and ``read_sync_s``: a
  fresh read-back whose every byte was read once on one thread (``read_s``), then committed
  (at 41a10d5 one byte a page changed nothing: whether a first read of every cache line is);
- ``usage``: for the commits of a fresh copy, of the held copy and of it again, where the
  CPU went (:func:`usage`): user and system seconds, minor faults, context switches, and
  the CPU of every thread by name (the commit's own, the runtime's); and ``few_sync_s``: a
  fresh read-back committed with :data:`FEW_HASHERS` hashing threads (the commit's extra
  CPU at 1c60ad0 was system time in its own threads);
- ``blocked_s`` / ``durable_s``: ``CheckpointCadence`` in the background, what the loop is
  blocked for and the time to durability.

``commit_over_floor`` is the median over rounds of ``sync_s`` ÷ max(floor a, floor b): the
commit overlaps the copy, the hashing and the writes, so it should take about the slower floor
(goal ≤ 1.25). Also one per-update state hash (host copy + hashes) of a fresh state.
"""

from __future__ import annotations

import gc
import math
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from device_check.common import log
from device_check.settings import MAX_STEPS, execution, llama_config, model_shape, seq_len
from device_check.thread_usage import usage

ROWS = ("device_to_host_s", "device_to_host_cpu_s", "raw_s", "raw_cpu_s", "sync_s", "sync_cpu_s",
        "read_back_s", "held_sync_s", "held_sync_cpu_s", "hot_sync_s", "hot_sync_cpu_s",
        "paused_sync_s", "paused_sync_cpu_s", "touch_s", "touch_cpu_s", "touched_sync_s",
        "touched_sync_cpu_s", "settled_sync_s", "settled_sync_cpu_s", "read_s", "read_sync_s",
        "read_sync_cpu_s", "few_sync_s", "few_sync_cpu_s", "blocked_s", "durable_s")  # fmt: skip
#: seconds between a fresh state's read-back and the commit of its held copy (paused_sync_s)
PAUSE_S = 2.0
#: hashing threads of the commit measured as ``few_sync_s``
FEW_HASHERS = 2
#: seconds between letting the previous state go and making the one committed (settled_sync_s)
SETTLE_S = 3.0


def _fresh(state, copy):
    """A new state computed on the device from ``state`` (no host copy cached yet), equal to
    it: every float array times 1, every integer one plus 0, the 1 and the 0 given at run time
    so that the compiler cannot fold the program into a copy it might skip."""
    import jax
    import jax.numpy as jnp

    fresh = copy(state, jnp.ones((), jnp.float32), jnp.zeros((), jnp.int32))
    jax.block_until_ready(fresh)
    return fresh


def _same(state, one, zero):
    import jax
    import jax.numpy as jnp

    def each(a):
        if jnp.issubdtype(a.dtype, jnp.floating):
            return a * one.astype(a.dtype)
        return a + zero.astype(a.dtype)

    return jax.tree.map(each, state)


def device_to_host(state) -> tuple[float, list]:
    """(seconds, the host arrays): every array's copy started at once, then each awaited."""
    import jax
    import numpy as np

    from minifield.state.arrays import named_leaves

    started = time.perf_counter()
    leaves = [leaf for _, leaf in named_leaves(state)]
    for leaf in leaves:
        if isinstance(leaf, jax.Array):
            leaf.copy_to_host_async()
    arrays = [np.asarray(leaf) for leaf in leaves]
    return time.perf_counter() - started, arrays


def touch(state) -> tuple[float, float]:
    """(seconds, CPU seconds) to read one byte of every 4 KiB page of ``state``'s host copy
    (JAX's, cached on each array), on this thread."""
    import numpy as np

    from minifield.state.arrays import named_leaves

    started, cpu = time.perf_counter(), time.process_time()
    for _, leaf in named_leaves(state):
        flat = np.asarray(leaf).reshape(-1).view(np.uint8)
        int(flat[::4096].sum(dtype=np.uint64))
    return time.perf_counter() - started, time.process_time() - cpu


def read_all(state) -> tuple[float, float]:
    """(seconds, CPU seconds) to read every byte of ``state``'s host copy once, on this
    thread (a sum over it as 8-byte words, 64 MiB at a time)."""
    import numpy as np

    from minifield.state.arrays import named_leaves

    started, cpu = time.perf_counter(), time.process_time()
    for _, leaf in named_leaves(state):
        flat = np.asarray(leaf).reshape(-1).view(np.uint8)
        words = flat[: flat.size - flat.size % 8].view(np.uint64)
        for start in range(0, words.size, 8 << 20):
            int(words[start : start + (8 << 20)].sum(dtype=np.uint64))
    return time.perf_counter() - started, time.process_time() - cpu


def raw_write(directory: Path, arrays: list) -> float:
    """Seconds to write ``arrays``' bytes as one file, fsync it, rename it and fsync the
    directory: a commit's durable writes with nothing else."""
    import numpy as np

    from minifield import atomic

    started = time.perf_counter()
    tmp, final = directory / "raw.tmp", directory / "raw.bin"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for array in arrays:
            view = memoryview(np.ascontiguousarray(array)).cast("B")
            while view:
                view = view[os.write(fd, view) :]
        os.fsync(fd)
    finally:
        os.close(fd)
    os.rename(tmp, final)
    atomic.fsync_dir(directory)
    seconds = time.perf_counter() - started
    final.unlink()
    return seconds


def _round(directory: Path, state, copy, step: int, pause_s: float) -> dict:
    """One round's figures, each of a fresh state (``pause_s``: :data:`PAUSE_S`, 0 with
    ``--tiny``, whose CPU host copy is a view)."""
    from checkpoint_commit import async_commit, sync_commit

    from minifield.state import pieces

    fresh = _fresh(state, copy)
    cpu = time.process_time()
    floor_a, host = device_to_host(fresh)
    floor_a_cpu = time.process_time() - cpu
    del fresh
    cpu = time.process_time()
    floor_b = raw_write(directory, host)
    floor_b_cpu = time.process_time() - cpu
    del host
    fresh = _fresh(state, copy)
    (wall, cpu), sync_usage = usage(lambda: sync_commit(directory / "sync", fresh, step))
    # the same commit of a fresh state read back first (JAX then holds its host copy): the
    # commit without the copy, to tell the copy's share of the commit from the hashing's
    # and the writes'
    fresh = _fresh(state, copy)
    read_back, _ = device_to_host(fresh)
    (held, held_cpu), held_usage = usage(lambda: sync_commit(directory / "held", fresh, step))
    # the same host copy committed once more: a host copy one commit has been through
    (hot, hot_cpu), hot_usage = usage(lambda: sync_commit(directory / "hot", fresh, step))
    # a fresh host copy committed after a pause: whether what slows the held commit is the
    # time since the device->host copy (its runtime threads still busy) or the copy itself
    fresh = _fresh(state, copy)
    device_to_host(fresh)
    time.sleep(pause_s)
    paused, paused_cpu = sync_commit(directory / "paused", fresh, step)
    fresh = _fresh(state, copy)
    device_to_host(fresh)
    touched, touched_cpu = touch(fresh)
    touched_sync, touched_sync_cpu = sync_commit(directory / "touched", fresh, step)
    # the previous state and its host copy let go well before: whether freeing them is it
    del fresh
    gc.collect()
    time.sleep(pause_s and SETTLE_S)
    fresh = _fresh(state, copy)
    device_to_host(fresh)
    settled, settled_cpu = sync_commit(directory / "settled", fresh, step)
    # every byte of a fresh copy read once first: whether a first read of it is it
    fresh = _fresh(state, copy)
    device_to_host(fresh)
    read, _ = read_all(fresh)
    (read_sync, read_sync_cpu), read_usage = usage(
        lambda: sync_commit(directory / "read", fresh, step)
    )
    # fewer hashing threads on a fresh copy: whether their number is what costs
    fresh = _fresh(state, copy)
    device_to_host(fresh)
    hashers, pieces.HASHERS = pieces.HASHERS, FEW_HASHERS
    try:
        (few, few_cpu), few_usage = usage(lambda: sync_commit(directory / "few", fresh, step))
    finally:
        pieces.HASHERS = hashers
    fresh = _fresh(state, copy)
    blocked, durable = async_commit(directory / "async", fresh, step)
    return {"device_to_host_s": floor_a, "device_to_host_cpu_s": floor_a_cpu, "raw_s": floor_b,
            "raw_cpu_s": floor_b_cpu, "sync_s": wall, "sync_cpu_s": cpu, "held_sync_s": held,
            "held_sync_cpu_s": held_cpu, "read_back_s": read_back, "hot_sync_s": hot,
            "hot_sync_cpu_s": hot_cpu, "paused_sync_s": paused, "paused_sync_cpu_s": paused_cpu,
            "touch_s": touched, "touch_cpu_s": touched_cpu, "touched_sync_s": touched_sync,
            "touched_sync_cpu_s": touched_sync_cpu, "settled_sync_s": settled,
            "settled_sync_cpu_s": settled_cpu, "read_s": read, "read_sync_s": read_sync,
            "read_sync_cpu_s": read_sync_cpu, "few_sync_s": few, "few_sync_cpu_s": few_cpu,
            "blocked_s": blocked, "durable_s": durable,
            "usage": {"sync": sync_usage, "held": held_usage, "hot": hot_usage,
                      "read": read_usage, "few": few_usage}}  # fmt: skip


def _ratios(out: dict, rows: dict, nbytes: int) -> None:
    median = {k: statistics.median(v) for k, v in rows.items()}
    out.update(median)
    out["raw_fsync_bytes_per_s"] = nbytes / median["raw_s"]
    out["device_to_host_bytes_per_s"] = nbytes / median["device_to_host_s"]
    out["sync_commit_bytes_per_s"] = nbytes / median["sync_s"]
    out["sync_over_raw_bandwidth"] = median["raw_s"] / median["sync_s"]
    out["blocking_over_sync_time"] = median["blocked_s"] / median["sync_s"]
    out["commit_over_floor_rounds"] = [
        s / max(a, b)
        for s, a, b in zip(rows["sync_s"], rows["device_to_host_s"], rows["raw_s"], strict=True)
    ]
    out["commit_over_floor"] = statistics.median(out["commit_over_floor_rounds"])


def _hash_split(state) -> dict:
    """The state's digests split as a commit hashes them: the arrays of small pieces one
    after another on one thread (the lane), the others on the hashing threads; each part's
    wall and CPU seconds alone, so the commit's critical path can be told apart."""
    import numpy as np

    from minifield.state import pieces
    from minifield.state.arrays import named_leaves

    host = {name: np.asarray(leaf) for name, leaf in named_leaves(state)}
    pooled = {
        n: pieces.pooled(a.nbytes, math.prod(pieces.piece_grid(a.shape))) for n, a in host.items()
    }
    out = {}
    for part, wanted in (("lane", False), ("pool", True)):
        arrays = {n: a for n, a in host.items() if pooled[n] == wanted}
        started, cpu = time.perf_counter(), time.process_time()
        pieces.host_digests(arrays)
        out[f"{part}_hash_s"] = time.perf_counter() - started
        out[f"{part}_hash_cpu_s"] = time.process_time() - cpu
        out[f"{part}_bytes"] = sum(a.nbytes for a in arrays.values())
    return out


def run(args, context, report) -> dict:
    from minifield.attempt import environment

    environment.add_gpu_determinism_flags()
    import jax
    import numpy as np

    from minifield.attempt.update_loop import HostSnapshot
    from minifield.state import pieces
    from minifield.state.arrays import named_leaves
    from minifield.training.optimizer import make_optimizer
    from minifield.training.train_step import init_train_state

    if args.pooled_piece_bytes:
        pieces.LARGE_PIECE = args.pooled_piece_bytes
    cfg = llama_config(model_shape(args, "125m"), seq_len(args), execution(args))
    optimizer = make_optimizer({}, MAX_STEPS)
    state = jax.jit(lambda: init_train_state(cfg, optimizer, seed=0))()
    copy = jax.jit(_same)
    leaves = named_leaves(state)
    nbytes = sum(int(np.dtype(a.dtype).itemsize) * math.prod(a.shape) for _, a in leaves)
    out = {"model": "125m", "state_bytes": nbytes, "arrays": len(leaves),
           "backend": jax.default_backend(), "rounds": args.checkpoint_rounds,
           "fresh_state": "computed on the device for every measurement (x * 1, i + 0)",
           "pooled_piece_bytes": pieces.LARGE_PIECE}  # fmt: skip
    report(out)
    directory = Path(tempfile.mkdtemp(prefix="checkpoint-", dir=args.work_dir))
    try:
        rows: dict = {k: [] for k in ROWS}
        pause_s = 0.0 if args.tiny else PAUSE_S
        for step in range(1, args.checkpoint_rounds + 1):
            spent = (
                sum(rows[k][-1] for k in ROWS if not k.endswith("cpu_s")) + pause_s
                if step > 1
                else 0
            )
            if time.time() + 1.5 * spent > args.deadline:  # stop rather than be killed
                log(f"  stopping after {step - 1} rounds (time limit)")
                break
            figures = _round(directory, state, copy, step, pause_s)
            out.setdefault("usage", []).append(figures.pop("usage"))
            for key, value in figures.items():
                rows[key].append(value)
            out["rounds_done"], out["all"] = step, rows
            report(out)
            log(f"  round {step}: " + ", ".join(f"{k} {v[-1]:.3f}" for k, v in rows.items()))
        _ratios(out, rows, nbytes)
        # what a per-update state hash costs at this size (host copy + hashes, as the loop)
        fresh = _fresh(state, copy)
        started, cpu = time.perf_counter(), time.process_time()
        snapshot = HostSnapshot()
        snapshot.hashes_of(fresh, 1)
        snapshot.forget()
        out["state_hash_s"] = time.perf_counter() - started
        out["state_hash_cpu_s"] = time.process_time() - cpu
        out.update(_hash_split(fresh))
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    return out
