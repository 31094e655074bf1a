"""One process of ``benchmarks/checkpoint_processes.py`` (and of the memory test): joins the
processes named by ``MINIFIELD_COORDINATOR`` / ``MINIFIELD_NUM_PROCESSES`` /
``MINIFIELD_PROCESS_ID`` (none: one process), creates a state of ``--mb`` MiB sharded over
all devices along its first axis (each process creating only its own slices) and saves it
(phase ``save``), or restores it into that layout in a fresh process (phase ``restore``),
with ``--writer`` (``minifield``: format 4 over several processes, format 3 in one;
``orbax``: Orbax's ``StandardCheckpointer``), sampling this process's resident set size
every 2 ms from a baseline (the state resident, for a save; the fresh process, for a
restore). Prints one JSON line per process on stdout.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import threading
import time
from pathlib import Path

import numpy as np

ROWS_PER_MIB = 256  # rows of 1024 float32 values


class PeakRSS:
    """The largest resident set size seen between ``start`` and ``stop``."""

    def __init__(self) -> None:
        self.page = os.sysconf("SC_PAGE_SIZE")
        self.peak = 0
        self._stop = threading.Event()
        self._thread = None

    def now(self) -> int:
        with open("/proc/self/statm") as handle:
            return int(handle.read().split()[1]) * self.page

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.now())
            time.sleep(0.002)

    def start(self) -> None:
        self.peak, self._stop = self.now(), threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return max(self.peak, self.now())


def build(mb: int, arrays: int):
    """The state's shardings and abstract template, and a function creating it."""
    import jax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    mesh = Mesh(np.array(jax.devices()), ("data",))
    sharded = NamedSharding(mesh, PartitionSpec("data"))
    replicated = NamedSharding(mesh, PartitionSpec())
    rows = mb * ROWS_PER_MIB // arrays
    shapes = {f"w{k:02d}": ((rows, 1024), sharded) for k in range(arrays)}
    shapes["step"] = ((), replicated)

    def make():
        out = {}
        for number, (name, (shape, sharding)) in enumerate(sorted(shapes.items())):

            def values(index, number=number, shape=shape):
                region = tuple(i.indices(n)[:2] for i, n in zip(index, shape, strict=True))
                block = tuple(b - a for a, b in region)
                seed = [number, *(a for a, _ in region)]
                return np.random.default_rng(seed).standard_normal(block, np.float32)

            dtype = np.float32 if shape else np.int32
            if not shape:
                out[name] = jax.make_array_from_callback((), sharding, lambda _i: np.int32(7))
            else:
                out[name] = jax.make_array_from_callback(shape, sharding, values)
            assert out[name].dtype == dtype
        return out

    abstract = {
        name: jax.ShapeDtypeStruct(shape, np.float32 if shape else np.int32, sharding=sharding)
        for name, (shape, sharding) in shapes.items()
    }
    return make, abstract


def save(args, group, abstract_make, rss: PeakRSS) -> dict:
    """Create the state, then save it; the baseline is the RSS with the state resident."""
    import jax

    from minifield.state import arrays, checkpoint, checkpoint_spread

    make, _abstract = abstract_make
    state = make()
    jax.block_until_ready(state)
    share = sum(s.data.nbytes for leaf in state.values() for s in leaf.addressable_shards)
    # the update loop hashes the state where it lives (state_hash_every: 1): not timed here
    digests = arrays.state_digests(state) if args.writer == "minifield" else None
    directory = Path(args.dir)
    gc.collect()
    group.barrier("save")
    out = {"share_bytes": share, "baseline": rss.now()}
    rss.start()
    started = time.monotonic()
    if args.writer == "minifield":
        if group.size > 1:
            checkpoint_spread.save(
                directory, state, step=1, computation_digest="c" * 64, group=group,
                digests=digests,
            )  # fmt: skip
        else:
            checkpoint.save(
                directory, state, step=1, computation_digest="c" * 64, known_digests=digests
            )
    else:
        import orbax.checkpoint as ocp

        with ocp.StandardCheckpointer() as writer:
            writer.save(directory.absolute() / "step-00000001", state)
            writer.wait_until_finished()
    group.barrier("saved")
    out["seconds"] = time.monotonic() - started
    out["peak"] = rss.stop()
    out["state_hash"] = arrays.state_hash(state)
    return out


def restore(args, group, abstract_make, rss: PeakRSS) -> dict:
    """Restore into the state's layout; the baseline is the RSS of this fresh process."""
    import jax

    from minifield.state import arrays, checkpoint
    from minifield.training.data_parallel import place_tree

    _make, abstract = abstract_make
    path = Path(args.dir).absolute() / checkpoint.step_dir_name(1)
    gc.collect()
    group.barrier("restore")
    out = {"baseline": rss.now()}
    rss.start()
    started = time.monotonic()
    if args.writer == "minifield":
        restored, manifest = checkpoint.load(path, abstract)
        state = place_tree(restored, {k: v.sharding for k, v in abstract.items()})
        del restored
        out["peak_placed"] = rss.peak  # before the hash check
        if manifest.get("sliced"):
            checkpoint.verify_placed(state, str(path), manifest["state_hash"])
    else:
        import orbax.checkpoint as ocp

        with ocp.StandardCheckpointer() as reader:
            state = reader.restore(path, abstract)
    jax.block_until_ready(state)
    group.barrier("restored")
    out["seconds"] = time.monotonic() - started
    out["peak"] = rss.stop()
    out["share_bytes"] = sum(
        s.data.nbytes for leaf in state.values() for s in leaf.addressable_shards
    )
    out["state_hash"] = arrays.state_hash(state)
    return out


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("phase", choices=("save", "restore"))
    parser.add_argument("--writer", choices=("minifield", "orbax"), default="minifield")
    parser.add_argument("--dir", required=True)
    parser.add_argument("--mb", type=int, default=1024)
    parser.add_argument("--arrays", type=int, default=16)
    args = parser.parse_args()
    from minifield.supervision import distributed

    topology = distributed.initialize()
    group = distributed.Group(topology)
    import jax

    rss = PeakRSS()
    run = save if args.phase == "save" else restore
    out = {"process": group.rank, **run(args, group, build(args.mb, args.arrays), rss)}
    print(json.dumps(out), flush=True)
    if topology.is_multi_process:
        jax.distributed.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
