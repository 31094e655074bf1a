"""One process of a checkpoint-by-parts check (run by tests/test_checkpoint_parts.py).

Joins the processes named by ``MINIFIELD_COORDINATOR`` / ``MINIFIELD_NUM_PROCESSES`` /
``MINIFIELD_PROCESS_ID`` (none: one process) over 4 devices in all, places a seeded state
on the mesh (``--shard``: ``shard_params``, else replicated) and runs updates 1..``--steps``
of an elementwise update (the same arithmetic on every topology), committing a checkpoint
after each update in ``--save`` (multi-process: format 4 through ``checkpoint_spread.save``;
one process: format 5 through ``checkpoint.save``). With ``--kill PHASE --kill-rank R
--kill-step S``, process R SIGKILLs itself at that phase of checkpoint S's write
(``opened``, ``part_written``, ``before_commit``). ``--background``: each checkpoint written
as an attempt's cadence does (``checkpoint_spread.BackgroundPart`` on a thread while the next
update runs, no collective off the main thread).

``--restore DIR`` instead restores the newest committed checkpoint of DIR into the state's
layout on this topology (each process reading its own slices), verifies the placed hash and
runs the remaining updates. Process 0 prints one JSON line: the state hash after every
update run here, the restored step, how many arrays were copied whole to the host
(``arrays.to_host``), the bytes this process read from the parts (``rchar``) and the state's
size. ``--resume-each DIR`` (repeatable): ``--restore DIR --save DIR`` for each DIR in turn,
in the same processes (one process start for several resumes); the report is then
``{"runs": [each DIR's report]}``. ``--also JSON`` (repeatable): after that, another run in
the same processes, ``{"steps": N, "restore": DIR or null, "save": DIR or null}`` (each from
the seeded state or DIR's newest checkpoint, as above); their reports are the report's
``"also"`` list, in order.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import uuid
from pathlib import Path

import numpy as np

from minifield.supervision import distributed


def make_state() -> dict:
    rng = np.random.default_rng(11)
    return {
        "params": {
            "embed": rng.standard_normal((480, 64), np.float32),  # sharded along axis 0
            "odd_rows": rng.standard_normal((3, 12), np.float32),  # along axis 1
            "layers": {"w": rng.standard_normal((2, 8, 4), np.float32)},  # stacked: axis 1
            "norm": rng.standard_normal((8,), np.float32),
            "odd": rng.standard_normal((3, 5), np.float32),  # replicated
        },
        "opt_state": {"mu": rng.standard_normal((480, 64), np.float32)},
        "step": np.int32(0),
    }


def _rchar() -> int:
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("rchar:"):
            return int(line.split()[1])
    return 0


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--shard", action="store_true")
    parser.add_argument("--save")
    parser.add_argument("--restore")
    parser.add_argument("--background", action="store_true")
    parser.add_argument("--kill")
    parser.add_argument("--kill-rank", type=int, default=0)
    parser.add_argument("--kill-step", type=int, default=0)
    parser.add_argument("--resume-each", action="append", default=[])
    parser.add_argument("--also", action="append", default=[], type=json.loads)
    args = parser.parse_args()
    topology = distributed.initialize()
    group = distributed.Group(topology)
    import jax

    from minifield.state import arrays, checkpoint, checkpoint_spread
    from minifield.training.data_parallel import DataParallel, place_tree

    gathers = []
    to_host = arrays.to_host

    def counting_to_host(leaf):
        if isinstance(leaf, jax.Array) and not leaf.is_fully_addressable:
            gathers.append(tuple(leaf.shape))
        return to_host(leaf)

    arrays.to_host = counting_to_host  # counts gathers across processes; the copy unchanged

    def update(state):
        out = jax.tree_util.tree_map(lambda a: a * 0.5 + 1, state)
        return {**out, "step": state["step"] + 1}

    update = jax.jit(update)
    host = make_state()
    abstract = jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(np.shape(a), a.dtype), host)
    dp = DataParallel(4, args.shard)
    shardings = dp.state_shardings(dp.mesh(), abstract)

    def run(restore: str | None, save: str | None, last: int = args.steps) -> dict:
        gathers.clear()
        out: dict = {"processes": jax.process_count(), "hashes": {}}
        if restore:
            return steps(out, *restored(out, restore), save, last)
        return steps(out, place_tree(host, shardings), 0, save, last)

    def restored(out: dict, restore: str):
        template = place_tree(host, shardings)  # the layout to restore into
        newest = checkpoint.committed_steps(Path(restore))[-1]
        path = Path(restore) / checkpoint.step_dir_name(newest)
        before = _rchar()
        restored, manifest = checkpoint.load(path, template)
        # bytes read by system calls, less the manifest's (read once, whole)
        out["read_bytes"] = _rchar() - before - (path / "manifest.json").stat().st_size
        out["state_bytes"] = sum(int(np.asarray(a).nbytes) for a in jax.tree_util.tree_leaves(host))
        state = place_tree(restored, shardings)
        if manifest.get("sliced"):
            checkpoint.verify_placed(state, str(path), manifest["state_hash"])
        out.update(restored_step=newest, sliced=bool(manifest.get("sliced")))
        out["restored_hash"] = arrays.state_hash(state)
        return state, newest

    def steps(out: dict, state, newest: int, save: str | None, last: int) -> dict:
        for step in range(newest + 1, last + 1):
            state = update(state)
            out["hashes"][step] = arrays.state_hash(state)
            if save:
                commit(state, step, Path(save), out)
        out["gathered"] = len(gathers)
        return out

    def commit(state, step: int, save: Path, out: dict) -> None:
        def fault(phase: str, step=step) -> None:
            if (phase, step, group.rank) == (args.kill, args.kill_step, args.kill_rank):
                os.kill(os.getpid(), signal.SIGKILL)

        if args.background:
            # as the attempt's cadence does: the part taken now, written on a thread while
            # the next update runs; the outcome exchanged on the main thread afterwards
            digests = arrays.state_digests(state)
            tag = group.broadcast_text(uuid.uuid4().hex[:12])  # new for every write
            part = checkpoint_spread.BackgroundPart(
                save, step, rank=group.rank, count=group.size, tag=tag
            ).take(state)
            done: dict = {}

            def write(part=part, digests=digests, fault=fault, done=done) -> None:
                done["record"] = part(computation_digest="c" * 64, digests=digests, fault=fault)

            thread = threading.Thread(target=write)
            thread.start()
            following = update(state)  # the next update, beside the write
            thread.join()
            assert group.gather_texts("ok" if "record" in done else "failed") == ["ok"] * 2
            assert jax.tree_util.tree_leaves(following)  # computed while written
            committed = done["record"]
        elif jax.process_count() > 1:
            committed = checkpoint_spread.save(
                save,
                state,
                step=step,
                computation_digest="c" * 64,
                group=group,
                digests=arrays.state_digests(state),
                fault=fault,
            )
        else:
            committed = checkpoint.save(save, state, step=step, computation_digest="c" * 64)
        assert committed.state_hash == out["hashes"][step]

    if args.resume_each:  # one process per rank resumes each directory in turn
        report = {"runs": [run(directory, directory) for directory in args.resume_each]}
    else:
        report = run(args.restore, args.save)
    if args.also:  # further runs in these processes: a process start saved for each
        report["also"] = [run(a["restore"], a["save"], a["steps"]) for a in args.also]
    if topology.is_writer:
        print(json.dumps(report, sort_keys=True), flush=True)
    if topology.is_multi_process:
        jax.distributed.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
