"""One process of a state-hash topology check (run by tests/test_state_hash_topology.py).

Joins the processes named by ``MINIFIELD_COORDINATOR`` / ``MINIFIELD_NUM_PROCESSES`` /
``MINIFIELD_PROCESS_ID`` (none: one process), builds the same state in every process
(seeded host arrays), places it on a 4-device mesh replicated and with ``shard_params``
(``DataParallel.state_shardings``), runs one jitted update of it (elementwise, so every
topology does the same arithmetic), and prints process 0's JSON: each placement's
version-3 state hash and part hashes before and after the update, and how many arrays the
hashes copied whole to the host (``arrays.to_host``, which gathers across processes; the
checkpoint writer's own copy is not counted).
With ``--checkpoint DIR`` (one process) the updated sharded state is also committed there.
With a fifth visible device (one process), a ``[10]`` array sharded over 5 devices (shards
that cut the pieces) is hashed too; with 32 (one process), a state sharded over 32 devices,
whose shards cut its pieces, hashed with no array gathered. ``--across`` (5 processes × 2
devices): only an array whose pieces lie across processes.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from minifield.supervision import distributed


def make_state() -> dict:
    rng = np.random.default_rng(7)
    return {
        "params": {
            "embed": rng.standard_normal((24, 8), np.float32),  # sharded along axis 0
            "odd_rows": rng.standard_normal((3, 12), np.float32),  # along axis 1
            "layers": {"w": rng.standard_normal((2, 8, 4), np.float32)},  # stacked: axis 1
            "norm": rng.standard_normal((8,), np.float32),
            "odd": rng.standard_normal((3, 5), np.float32),  # no axis 4 divides: replicated
        },
        "opt_state": {"mu": rng.standard_normal((24, 8), np.float32)},
        "rng": np.array([1, 2], np.uint32),
        "step": np.int32(3),
        "cursor": np.int32(17),
    }


def _thirty_two_devices(state: dict, gathers: list) -> dict:
    """The state with 32 more rows per array, sharded over 32 devices (``shard_params``):
    shards of 1 to 2 rows, smaller than the pieces (a 64-row axis has 16 pieces of 4)."""
    import jax

    from minifield.state import arrays
    from minifield.training.data_parallel import DataParallel, place_tree

    rng = np.random.default_rng(32)
    state["params"]["embed"] = rng.standard_normal((64, 8), np.float32)
    state["params"]["wide"] = rng.standard_normal((5, 96), np.float32)
    state["opt_state"]["mu"] = rng.standard_normal((32, 3), np.float32)
    abstract = jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(np.shape(a), a.dtype), state)
    dp = DataParallel(32, True)
    placed = place_tree(state, dp.state_shardings(dp.mesh(), abstract))
    before, whole_copies = len(gathers), []
    device_get = jax.device_get

    def counting_device_get(value):
        if len(getattr(getattr(value, "sharding", None), "device_set", ())) > 1:
            whole_copies.append(value.shape)  # a sharded array copied whole to the host
        return device_get(value)

    jax.device_get = counting_device_get
    try:
        hashed = arrays.state_hash(placed)
    finally:
        jax.device_get = device_get
    return {
        "hash": hashed,
        "one_device": arrays.state_hash(state),
        "sharded": sum(not a.is_fully_replicated for a in jax.tree_util.tree_leaves(placed)),
        "gathered": len(gathers) - before,
        "whole_copies": len(whole_copies),
    }


def _across_processes() -> dict:
    """A ``[20, 3]`` array split over every device (shards of 2 rows on 5 processes × 2
    devices) while its pieces are 5 rows: pieces lie across processes, so the hash lays it
    out again (``regions.regrouped``) rather than gathering it."""
    import jax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from minifield.state import arrays, pieces, regions

    gathers = []
    to_host = arrays.to_host

    def counting_to_host(leaf):
        gathers.append(tuple(leaf.shape))
        return to_host(leaf)

    arrays.to_host = counting_to_host
    value = np.random.default_rng(20).standard_normal((20, 3), np.float32)
    mesh = Mesh(np.array(jax.devices()), ("data",))
    laid = jax.make_array_from_callback(
        value.shape, NamedSharding(mesh, PartitionSpec("data")), lambda index: value[index]
    )
    again = regions.regrouped(laid, [5, 1])
    return {
        "hash": arrays.state_hash({"v": laid}),
        "one_device": arrays.state_hash({"v": value}),
        "array_digest": pieces.array_digest(value),
        "digest": pieces.state_digests([("v", laid)], arrays.to_host)["v"],
        "gathered": len(gathers),
        "rows_held": sorted({s.data.shape[0] for s in again.addressable_shards}),
    }


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--checkpoint")
    parser.add_argument("--across", action="store_true", help="only the pieces-across case")
    args = parser.parse_args()
    topology = distributed.initialize()
    if args.across:
        report = _across_processes()
        if topology.is_writer:
            print(json.dumps(report, sort_keys=True), flush=True)
        if topology.is_multi_process:
            import jax

            jax.distributed.shutdown()
        return 0
    import jax

    from minifield.state import arrays, checkpoint
    from minifield.training.data_parallel import DataParallel, place_tree

    gathers = []
    to_host = arrays.to_host

    def counting_to_host(leaf):
        gathers.append(tuple(leaf.shape))
        return to_host(leaf)

    arrays.to_host = counting_to_host  # counts whole-array copies; the copy is unchanged

    state = make_state()
    update = jax.jit(lambda s: jax.tree_util.tree_map(lambda a: a * 3 + 1, s))
    abstract = jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(np.shape(a), a.dtype), state)
    out: dict = {"processes": jax.process_count(), "devices": jax.device_count()}
    for name, shard in (("replicated", False), ("shard_params", True)):
        dp = DataParallel(4, shard)
        mesh = dp.mesh()
        placed = place_tree(state, dp.state_shardings(mesh, abstract))
        after = update(placed)
        before_hash = arrays.state_hash(placed)
        whole, parts = arrays.hashes(after)
        out[name] = {
            "before": before_hash,
            "after": whole,
            "parts": parts,
            "sharded": sum(not a.is_fully_replicated for a in jax.tree_util.tree_leaves(after)),
        }
        out["gathered_by_hashes"] = len(gathers)
        if shard and args.checkpoint:
            committed = checkpoint.save(
                Path(args.checkpoint),
                after,
                step=1,
                computation_digest="c" * 64,
            )
            out["checkpoint"] = {"path": committed.path, "state_hash": committed.state_hash}
    if jax.device_count() >= 5 and jax.process_count() == 1:
        from jax.sharding import Mesh, NamedSharding, PartitionSpec

        mesh5 = Mesh(jax.devices()[:5], ("data",))
        value = np.arange(10, dtype=np.float32)
        cut = jax.device_put(value, NamedSharding(mesh5, PartitionSpec("data")))
        out["cut"] = {
            "hash": arrays.state_hash({"v": cut}),
            "one_device": arrays.state_hash({"v": value}),
        }
    if jax.device_count() >= 32 and jax.process_count() == 1:
        out["thirty_two"] = _thirty_two_devices(make_state(), gathers)
    out["one_device"] = {
        "before": arrays.state_hash(state),
        "after": arrays.state_hash(update(state)),
    }
    if topology.is_writer:
        print(json.dumps(out, sort_keys=True), flush=True)
    if topology.is_multi_process:
        jax.distributed.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
