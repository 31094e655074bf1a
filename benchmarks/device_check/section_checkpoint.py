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
  through: on the chip a third of the CPU of the first commit of it, docs/tpu.md);
- ``hashers_N_sync_s``: a fresh read-back committed with N hashing threads, N in
  :data:`HASHER_COUNTS` (``pieces.HASHERS`` is 8 on the chip's host): the extra CPU of a fresh
  copy's commit there is system time in the hashing threads, growing with their number;
- ``unreused_sync_s``: a fresh read-back committed with the hashing threads copying each
  non-contiguous piece into a new buffer (``pieces._SCRATCH_MAX`` -1), as before they reused
  one: whether allocation is the hashing threads' system time;
- ``usage``: for each of those commits, where the CPU went
  (:func:`device_check.thread_usage.usage`): user and system seconds and each thread's by
  name (the commit's own, the runtime's);
- ``blocked_s`` / ``durable_s``: ``CheckpointCadence`` in the background, what the loop is
  blocked for and the time to durability.

``commit_over_floor`` is the median over rounds of ``sync_s`` ÷ max(floor a, floor b): the
commit overlaps the copy, the hashing and the writes, so it should take about the slower floor
(goal ≤ 1.25). Also one per-update state hash (host copy + hashes) of a fresh state. (Earlier
rounds also committed a fresh copy after a pause, after touching its pages, after reading
every byte, after letting the last copy go: none was cheaper, docs/tpu.md.)
"""

from __future__ import annotations

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

#: hashing threads of the commits measured as ``hashers_N_sync_s``
HASHER_COUNTS = (1, 2, 4)
ROWS = ("device_to_host_s", "device_to_host_cpu_s", "raw_s", "raw_cpu_s", "sync_s", "sync_cpu_s",
        "read_back_s", "held_sync_s", "held_sync_cpu_s", "hot_sync_s", "hot_sync_cpu_s",
        *(f"hashers_{n}_sync{cpu}_s" for n in HASHER_COUNTS for cpu in ("", "_cpu")),
        "unreused_sync_s", "unreused_sync_cpu_s",
        "blocked_s", "durable_s")  # fmt: skip


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


def _round(directory: Path, state, copy, step: int) -> dict:
    """One round's figures, each of a fresh state."""
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
    out, spent = {"device_to_host_s": floor_a, "device_to_host_cpu_s": floor_a_cpu,
                  "raw_s": floor_b, "raw_cpu_s": floor_b_cpu}, {}  # fmt: skip

    def commit(key: str, held: bool = False) -> None:
        """``key``'s commit of ``fresh``: a fresh state, or (``held``) its host copy read back
        first (the commit without the device->host copy)."""
        if held:
            read_back = device_to_host(fresh)[0]
            out.setdefault("read_back_s", read_back)  # the held commit's
        (out[f"{key}_s"], out[f"{key}_cpu_s"]), spent[key] = usage(
            lambda: sync_commit(directory / key, fresh, step)
        )

    fresh = _fresh(state, copy)
    commit("sync")
    fresh = _fresh(state, copy)
    commit("held_sync", held=True)
    commit("hot_sync")  # the same host copy again: one commit has been through it
    hashers = pieces.HASHERS
    try:
        for count in HASHER_COUNTS:
            pieces.HASHERS = count
            fresh = _fresh(state, copy)
            commit(f"hashers_{count}_sync", held=True)
    finally:
        pieces.HASHERS = hashers
    scratch = pieces._SCRATCH_MAX
    try:  # every non-contiguous piece copied into a buffer of its own, as before the reuse
        pieces._SCRATCH_MAX = -1
        fresh = _fresh(state, copy)
        commit("unreused_sync", held=True)
    finally:
        pieces._SCRATCH_MAX = scratch
    fresh = _fresh(state, copy)
    out["blocked_s"], out["durable_s"] = async_commit(directory / "async", fresh, step)
    return {**out, "usage": spent}


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
        for step in range(1, args.checkpoint_rounds + 1):
            spent = sum(rows[k][-1] for k in ROWS if not k.endswith("cpu_s")) if step > 1 else 0
            if time.time() + 1.5 * spent > args.deadline:  # stop rather than be killed
                log(f"  stopping after {step - 1} rounds (time limit)")
                break
            figures = _round(directory, state, copy, step)
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
