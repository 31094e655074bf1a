"""Checkpoints written by parts (format 4): every process writes the blocks its devices hold,
process 0 commits once all parts are durable, and any topology restores them reading only
its own slices. The references are independent: the raw part files assembled by hand
(``checkpoint_by_hand``), and the hashes of an uninterrupted run on one process.

The multi-process cases start ``tests/checkpoint_parts_probe.py`` as 1, 2 or 4 processes
joined on loopback (4 forced host devices in all).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import loopback
import numpy as np
import pytest
from checkpoint_by_hand import state_hash_by_hand, verify_checkpoint_by_hand

from minifield.state import checkpoint, checkpoint_spread, regions
from minifield.supervision.distributed import Group

PROBE = Path(__file__).with_name("checkpoint_parts_probe.py")
DIGEST = "c" * 64


def run_probe(count: int, *args: str, killed: int | None = None) -> dict | None:
    """Process 0's report of ``count`` processes (4 devices in all) running the probe. With
    ``killed``, that process must die of SIGKILL; the others (stuck in a collective) are
    then killed, as the launcher would, and None is returned."""
    port = loopback.free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, str(PROBE), *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            # the session's light compile flags too (loopback.cpu_env): every run whose
            # hashes these tests compare is started here, so all compile alike
            env=loopback.cpu_env(
                4 // count,
                {
                    "MINIFIELD_COORDINATOR": f"127.0.0.1:{port}",
                    "MINIFIELD_NUM_PROCESSES": str(count),
                    "MINIFIELD_PROCESS_ID": str(rank),
                }
                if count > 1
                else {},
            ),
        )
        for rank in range(count)
    ]
    try:
        if killed is not None:
            assert procs[killed].wait(timeout=240) == -signal.SIGKILL, procs[killed].stderr.read()
            time.sleep(0.5)
            return None
        outputs = [proc.communicate(timeout=240) for proc in procs]
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
    for proc, (_out, err) in zip(procs, outputs, strict=True):
        assert proc.returncode == 0, err[-3000:]
    return json.loads(outputs[0][0].strip().splitlines()[-1])


def also(steps: int, restore: Path | None = None, save: Path | None = None) -> list[str]:
    """The probe's ``--also``: one more run in the processes already started."""
    spec = {"steps": steps, "restore": restore and str(restore), "save": save and str(save)}
    return ["--also", json.dumps(spec)]


@pytest.fixture(scope="module")
def one_process(tmp_path_factory) -> dict:
    """One process over 4 devices, parameters sharded. Its first run: the state hash after
    each of 5 updates, no checkpoint (the reference, :func:`uninterrupted`); then, in the same
    process (a start fewer), checkpoints of updates 1..2 written by it alone (format 5)."""
    directory = tmp_path_factory.mktemp("one-part") / "checkpoints"
    report = run_probe(1, "--shard", "--steps", "5", *also(2, save=directory))
    return {"hashes": report["hashes"], "one_file": directory, "saved": report["also"][0]}


@pytest.fixture(scope="module")
def uninterrupted(one_process) -> dict:
    """The state hash after each of 5 updates, one process over 4 devices, no checkpoint."""
    return one_process["hashes"]


KILLS = [
    ("opened", 1, "--collective"),
    ("part_written", 1, "--collective"),
    ("before_commit", 0, "--collective"),
    ("part_written", 1, "--background"),
    ("before_commit", 0, "--background"),
]


def _write_args(directory: Path, mode: str) -> list[str]:
    return ["--shard", "--save", str(directory), "--steps", "3"] + (
        ["--background"] if mode == "--background" else []
    )


@pytest.fixture(scope="module")
def killed_and_resumed(tmp_path_factory, one_process) -> dict:
    """Each of :data:`KILLS`: a 2-process write SIGKILLed there (the steps committed right
    after it), then resumed in the same directory. The resumes of one mode share 2 processes
    (each directory restored and run on in turn), which start once. The collective mode's
    two (2 × 2 devices, parameters sharded, no background write) first write
    ``cases["written"]`` (:func:`written`) and last restore the one-process checkpoint
    (``cases["one_file"]``): two process starts fewer for each."""
    cases: dict = {}
    for phase, rank, mode in KILLS:
        directory = tmp_path_factory.mktemp(f"kill-{phase}-{mode[2:]}")
        args = _write_args(directory, mode)
        kill = ["--kill", phase, "--kill-rank", str(rank), "--kill-step", "2"]
        run_probe(2, *args, *kill, killed=rank)
        cases[phase, rank, mode] = {
            "dir": directory,
            "committed_after_kill": checkpoint.committed_steps(directory),
        }
    written = tmp_path_factory.mktemp("parts") / "checkpoints"
    for mode in ("--collective", "--background"):
        keys = [key for key in KILLS if key[2] == mode]
        if mode == "--collective":
            resumes = [x for key in keys for x in also(3, cases[key]["dir"], cases[key]["dir"])]
            one_file = also(4, restore=one_process["one_file"])
            report = run_probe(2, *_write_args(written, mode), *resumes, *one_file)
            *runs, cases["one_file"] = report.pop("also")
            cases["written"] = {"dir": written, "report": report}
        else:
            each = [arg for key in keys for arg in ("--resume-each", str(cases[key]["dir"]))]
            runs = run_probe(2, "--shard", "--steps", "3", "--background", *each)["runs"]
        for key, run in zip(keys, runs, strict=True):
            cases[key]["report"] = run
    return cases


@pytest.fixture(scope="module")
def written(killed_and_resumed) -> Path:
    """Checkpoints of updates 1..3 written by 2 processes × 2 devices, parameters sharded
    (the first run of the processes that then resume the collective kills)."""
    report = killed_and_resumed["written"]["report"]
    assert report["gathered"] == 0  # nothing copied whole across processes
    return killed_and_resumed["written"]["dir"]


@pytest.mark.slow
def test_two_processes_write_their_own_parts(written, uninterrupted):
    path = written / "step-00000003"
    manifest, arrays = verify_checkpoint_by_hand(path)  # raw parts assembled by hand
    assert manifest["format"] == "minifield-checkpoint/4"
    assert [p["file"] for p in manifest["parts"]] == [
        "arrays-00000-of-00002.bin",
        "arrays-00001-of-00002.bin",
    ]
    assert manifest["state_hash"] == uninterrupted["3"] == state_hash_by_hand(arrays)
    blocks = {entry["name"]: entry["blocks"] for entry in manifest["arrays"]}
    # a sharded array: 4 device blocks stored once each, 2 by each process
    assert sorted(b["region"] for b in blocks["params/embed"]) == [
        [[0, 120], [0, 64]], [[120, 240], [0, 64]], [[240, 360], [0, 64]], [[360, 480], [0, 64]],
    ]  # fmt: skip
    assert sorted(b["part"] for b in blocks["params/embed"]) == [0, 0, 1, 1]
    # replicated arrays: one block each, written by one process or the other in turn
    replicated = [b for name, bs in blocks.items() if len(bs) == 1 for b in bs]
    assert {b["part"] for b in replicated} == {0, 1}
    # the 1-process reader (a one-device template: every array read whole) gives the values
    template = {name: np.zeros(a.shape, a.dtype) for name, a in arrays.items()}
    restored, _ = checkpoint.load(path, _nest(template), computation_digest=DIGEST)
    flat = dict(_flatten(restored))
    for name, array in arrays.items():
        np.testing.assert_array_equal(np.asarray(flat[name]), array)


@pytest.mark.slow
@pytest.mark.parametrize(("count", "layout"), [(1, "--shard"), (4, "--shard"), (2, "--replicated")])
def test_another_topology_restores_reading_its_own_slices(written, uninterrupted, count, layout):
    copy = written.parent / f"restore-{count}{layout}"
    shutil.copytree(written, copy)
    args = ["--restore", str(copy), "--steps", "5"] + (["--shard"] if layout == "--shard" else [])
    report = run_probe(count, *args)
    assert report["sliced"] is (layout == "--shard") and report["restored_step"] == 3
    assert report["restored_hash"] == uninterrupted["3"]
    assert report["hashes"] == {"4": uninterrupted["4"], "5": uninterrupted["5"]}
    assert report["gathered"] == 0
    # process 0 read (system calls counted by the kernel) all of it on one process holding
    # every device, about a quarter over 4 processes (the two large arrays' quarter and the
    # small arrays whole), all of it replicated
    share = {1: 1.0, 4: 0.25, 2: 1.0}[count]
    assert report["read_bytes"] == pytest.approx(share * report["state_bytes"], rel=0.1, abs=4096)


@pytest.mark.slow
def test_a_one_process_checkpoint_restores_on_two_processes(one_process, killed_and_resumed):
    """Written by the one process (after its uninterrupted run), restored by two processes
    (in the collective resumes' processes, after those)."""
    uninterrupted = one_process["hashes"]
    # the saving run computed what the uninterrupted one did
    assert one_process["saved"]["hashes"] == {"1": uninterrupted["1"], "2": uninterrupted["2"]}
    directory = one_process["one_file"]
    assert checkpoint.committed_steps(directory) == [1, 2]
    assert json.loads((directory / "step-00000002" / "manifest.json").read_text())["format"] == (
        "minifield-checkpoint/5"
    )
    report = killed_and_resumed["one_file"]
    assert report["processes"] == 2 and report["restored_step"] == 2
    assert report["sliced"] and report["restored_hash"] == uninterrupted["2"]
    assert report["hashes"] == {"3": uninterrupted["3"], "4": uninterrupted["4"]}


@pytest.mark.slow
@pytest.mark.parametrize(("phase", "rank", "mode"), KILLS)
def test_a_kill_during_a_write_leaves_the_previous_checkpoint(
    killed_and_resumed, uninterrupted, phase, rank, mode
):
    """SIGKILL before any part is written, between the parts (process 1's durable, process
    0's racing), and before the commit, in the collective commit and in the background one
    (written on a thread while the next update runs): checkpoint 2 is never adopted, 1
    resumes, and the resumed run (writing into the same directory) reaches the
    uninterrupted hashes."""
    case = killed_and_resumed[phase, rank, mode]
    directory, report = case["dir"], case["report"]
    assert case["committed_after_kill"] == [1]
    assert report["restored_step"] == 1 and report["restored_hash"] == uninterrupted["1"]
    assert report["hashes"] == {"2": uninterrupted["2"], "3": uninterrupted["3"]}
    assert checkpoint.committed_steps(directory) == [1, 2, 3]
    if mode == "--collective":  # the background commit's leftover goes at the next prune
        assert not [p for p in directory.iterdir() if p.name.startswith(".tmp-")]
    _, arrays = verify_checkpoint_by_hand(directory / "step-00000003")
    assert state_hash_by_hand(arrays) == uninterrupted["3"]


# -- one process (format 4 with one part): the reader's refusals ---------------------------------


def _nest(flat: dict) -> dict:
    out: dict = {}
    for name, value in flat.items():
        *parents, leaf = name.split("/")
        node = out
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = value
    return out


def _flatten(tree, prefix=""):
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            yield from _flatten(value, name + "/")
        else:
            yield name, value


def _state() -> dict:
    rng = np.random.default_rng(3)
    return {
        "params": {"w": rng.standard_normal((6, 4), np.float32), "b": np.arange(3, dtype=np.int32)},
        "step": np.int32(7),
    }


def _save_one_part(directory: Path, state: dict, step: int = 1) -> Path:
    from minifield.state.arrays import array_digests, named_arrays

    committed = checkpoint_spread.save(
        directory,
        state,
        step=step,
        computation_digest=DIGEST,
        group=Group(),
        digests=array_digests(named_arrays(state)),
    )
    return Path(committed.path)


def test_one_process_writes_format_4_readable_by_hand(tmp_path):
    state = _state()
    path = _save_one_part(tmp_path, state)
    manifest, arrays = verify_checkpoint_by_hand(path)
    assert manifest["format"] == "minifield-checkpoint/4" and len(manifest["parts"]) == 1
    assert manifest["state_hash"] == state_hash_by_hand(dict(_flatten(state)))
    restored, _ = checkpoint.load(path, state, computation_digest=DIGEST)
    np.testing.assert_array_equal(restored["params"]["w"], state["params"]["w"])
    with pytest.raises(checkpoint.CheckpointError, match="not greater than the last committed"):
        _save_one_part(tmp_path, state)


def test_a_corrupt_missing_or_truncated_part_is_refused_naming_it(tmp_path):
    state = _state()
    path = _save_one_part(tmp_path, state)
    part = path / "arrays-00000-of-00001.bin"
    data = bytearray(part.read_bytes())
    data[3] ^= 0xFF
    part.write_bytes(bytes(data))
    with pytest.raises(checkpoint.CheckpointError, match=r"arrays-00000-of-00001.bin.*sha256"):
        checkpoint.load(path, state)
    part.write_bytes(bytes(data[:-8]))
    with pytest.raises(checkpoint.CheckpointError, match=r"arrays-00000-of-00001.bin.*truncated"):
        checkpoint.load(path, state)
    part.unlink()
    with pytest.raises(checkpoint.CheckpointError, match=r"arrays-00000-of-00001.bin.*unreadable"):
        checkpoint.load(path, state)


def test_blocks_that_do_not_tile_an_array_are_refused(tmp_path):
    path = _save_one_part(tmp_path, _state())
    manifest_path = path / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    entry = next(e for e in manifest["arrays"] if e["name"] == "params/w")
    entry["blocks"][0]["region"] = [[0, 3], [0, 4]]  # half the array, the size still the whole's
    manifest_path.write_text(json.dumps(manifest))
    with pytest.raises(checkpoint.CheckpointError, match=r"arrays\[\d\].*nbytes"):
        checkpoint.load(path, _state())
    entry["blocks"][0].update(region=[[0, 3], [0, 4]], nbytes=48)
    manifest_path.write_text(json.dumps(manifest))
    with pytest.raises(checkpoint.CheckpointError, match="do not cover"):
        checkpoint.load(path, _state())


def test_a_region_is_read_from_the_blocks_it_overlaps(tmp_path):
    """Three stored blocks of a [6, 4] array in one file; regions that match a block, hold
    two whole blocks, and cut blocks all read back the values (only whole blocks checked)."""
    values = np.arange(24, dtype=np.float32).reshape(6, 4)
    cuts = [((0, 2), (0, 4)), ((2, 4), (0, 4)), ((4, 6), (0, 4))]
    file, stored, offset = tmp_path / "blocks.bin", [], 0
    with open(file, "wb") as handle:
        for region in cuts:
            data = values[tuple(slice(a, b) for a, b in region)].tobytes()
            handle.write(data + bytes(-len(data) % 64))
            sha = __import__("hashlib").sha256(data).hexdigest()
            stored.append(regions.Stored(region, "blocks.bin", offset, len(data), sha))
            offset += len(data) + (-len(data) % 64)
    fd = os.open(file, os.O_RDONLY)
    try:
        for region, whole_blocks in [
            (((2, 4), (0, 4)), True),
            (((0, 4), (0, 4)), True),
            (((1, 5), (1, 3)), False),
            (((0, 6), (0, 4)), True),
        ]:
            got, verified = regions.read("v", region, values.dtype, stored, lambda _f: fd)
            np.testing.assert_array_equal(got, values[tuple(slice(a, b) for a, b in region)])
            assert verified is whole_blocks
    finally:
        os.close(fd)


@pytest.mark.slow
def test_each_process_holds_about_its_share_during_a_save_and_a_restore(tmp_path):
    """4 processes, a 64 MiB state sharded over them: a save adds almost nothing to a
    process's resident set (it writes from the arrays' memory; gathering the state, as a
    one-writer checkpoint must, adds 3 shares), a restore in fresh processes adds about one
    share. Bounds looser than the benchmark's (``benchmarks/checkpoint_processes.py``, 1 GiB:
    0.00 and 1.13–1.26): small states carry fixed costs."""
    script = Path(__file__).parents[1] / "benchmarks" / "_checkpoint_process.py"
    for phase, bound in (("save", 0.5), ("restore", 2.0)):
        argv = [str(script), phase, "--dir", str(tmp_path), "--mb", "64"]
        outputs = loopback.run_all(argv, 4, 1)
        reports = [
            json.loads([x for x in o.splitlines() if x.startswith("{")][-1]) for o in outputs
        ]
        for report in reports:
            assert abs(report["share_bytes"] - (16 << 20)) <= 4  # + the replicated scalar
            assert report["peak"] - report["baseline"] <= bound * report["share_bytes"], report
        assert len({r["state_hash"] for r in reports}) == 1
