"""The training loop without host stalls: late metrics, the state-hash cadence, background
checkpoint commits (durable before they are reported, in step order, failures never dropped).

Fast tests run the real classes in-process on real files; the reference values are computed
here by hand (sha256 of the files and of the canonical state serialisation) or by the
synchronous ``Program.step`` path. The slow test fills the "disk" of a real worker process
(``RLIMIT_FSIZE``, set on the running worker once its first checkpoint is on disk).
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import resource
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
from checkpoint_by_hand import state_hash_by_hand, verify_checkpoint_by_hand
from conftest import (
    linear_recipe,
    read_events,
    small_sft_inputs,
    small_sft_recipe,
    worker_command,
    write_recipe,
)

from minifield.attempt.checkpoint_cadence import CheckpointCadence
from minifield.attempt.checkpoint_writer import CheckpointWriteError
from minifield.attempt.events import EventLog
from minifield.attempt.faults import Faults
from minifield.attempt.hash_cadence import HashCadence
from minifield.attempt.result import Progress
from minifield.state import checkpoint
from minifield.supervision import distributed


def _verify_by_hand(path: Path, expected: dict[str, np.ndarray]) -> dict:
    manifest, loaded = verify_checkpoint_by_hand(path)
    assert sorted(loaded) == sorted(expected)
    for name, array in expected.items():
        assert loaded[name].dtype == array.dtype and np.array_equal(loaded[name], array), name
    assert manifest["state_hash"] == state_hash_by_hand(expected)
    return manifest


def _state(seed: int) -> dict:
    rng = np.random.default_rng(seed)
    return {
        "params": {"w": rng.standard_normal((64, 48)).astype(np.float32), "b": np.zeros(48)},
        "opt_state": {"mu": rng.standard_normal((64, 48)).astype(np.float32)},
        "rng": np.array([seed, 7], np.uint32),
        "step": np.array(seed, np.int32),
        "cursor": np.array(3 * seed, np.int32),
    }


def _flat(state: dict) -> dict[str, np.ndarray]:
    out = {}
    for part, value in state.items():
        if isinstance(value, dict):
            out.update({f"{part}/{k}": v for k, v in value.items()})
        else:
            out[part] = value
    return out


class _DurabilityCheckingStream(io.StringIO):
    """The event stream, which checks at the moment a ``checkpoint_committed`` line arrives
    that the checkpoint it names is already on disk with its manifest."""

    def write(self, text: str) -> int:
        for line in text.splitlines():
            event = json.loads(line)
            if event["type"] == "checkpoint_committed":
                assert (Path(event["path"]) / "manifest.json").is_file(), event
        return super().write(text)


def _checkpointing(tmp_path: Path, echo) -> CheckpointCadence:
    return CheckpointCadence(
        tmp_path / "checkpoints",
        computation_digest="c" * 64,
        attempt_id="a",
        every_steps=2,
        max_steps=100,
        keep=5,
        group=distributed.Group(),
        events=EventLog(tmp_path / "events.jsonl", echo),
        faults=Faults(),
    )


def test_background_commits_are_reported_once_durable_in_step_order(tmp_path):
    stream = _DurabilityCheckingStream()
    checkpoints = _checkpointing(tmp_path, stream)
    assert checkpoints.writer is not None
    states = {2: _state(2), 4: _state(4), 6: _state(6)}
    for step in (1, 2, 3, 4, 5, 6):  # only the cadence's steps commit
        if checkpoints.due(step):
            checkpoints.on_cadence(states[step], step, float(step))
        checkpoints.collect()
    checkpoints.wait()
    events = [json.loads(line) for line in stream.getvalue().splitlines()]
    assert [e["step"] for e in events] == [2, 4, 6]
    assert all(e["asynchronous"] for e in events)
    for event in events:
        manifest = _verify_by_hand(Path(event["path"]), _flat(states[event["step"]]))
        assert event["state_hash"] == manifest["state_hash"]
        assert (
            event["sha256"]
            == hashlib.sha256((Path(event["path"]) / "manifest.json").read_bytes()).hexdigest()
        )
    assert checkpoints.newest.step == 6
    # the same bytes as a synchronous commit writes
    sync = checkpoint.save(tmp_path / "sync", states[6], step=6, computation_digest="c" * 64)
    sync_manifest = json.loads((Path(sync.path) / "manifest.json").read_text())
    assert [e["digest"] for e in sync_manifest["arrays"]] == [
        e["digest"]
        for e in json.loads((Path(events[-1]["path"]) / "manifest.json").read_text())["arrays"]
    ]


def test_a_failed_background_write_fails_loudly_and_keeps_the_previous_checkpoint(tmp_path):
    checkpoints = _checkpointing(tmp_path, None)
    good = _state(2)
    checkpoints.on_cadence(good, 2, 2.0)
    checkpoints.wait()
    # something the write cannot replace sits where checkpoint 4 is assembled
    blocker = tmp_path / "checkpoints" / f".tmp-step-00000004-{os.getpid()}"
    blocker.write_text("in the way")
    checkpoints.on_cadence(_state(4), 4, 4.0)
    with pytest.raises(CheckpointWriteError, match="step 4") as failure:
        checkpoints.wait()
    assert str(blocker) in str(failure.value)
    with pytest.raises(CheckpointWriteError):  # never dropped: asked again, it fails again
        checkpoints.collect()
    assert checkpoints.newest.step == 2
    assert checkpoint.committed_steps(tmp_path / "checkpoints") == [2]
    _verify_by_hand(tmp_path / "checkpoints" / "step-00000002", _flat(good))
    events = read_events(tmp_path / "events.jsonl")
    assert [(e["type"], e["step"]) for e in events] == [("checkpoint_committed", 2)]


def test_hash_cadence_parses_what_config_and_command_line_give():
    assert HashCadence.parse(True).every == 1 and HashCadence.parse("1").every == 1
    assert HashCadence.parse(8).every == 8 and HashCadence.parse("8").due(16)
    assert not HashCadence.parse(8).due(12)
    for none in (False, None, "checkpoint"):
        assert HashCadence.parse(none).every is None and not HashCadence.parse(none).due(4)
    for bad in (0, -2, "often", 1.5):
        with pytest.raises(ValueError, match="positive integer K"):
            HashCadence.parse(bad)


def test_the_loop_reports_every_update_late_but_in_order_with_the_same_values(tmp_path):
    """The update loop (dispatch, metrics read one update late, hashes every 3rd update,
    checkpoints in the background) against the synchronous ``Program.step`` path with every
    state hashed by hand: same losses, same hashes, every update reported in step order."""
    import jax

    from minifield import recipe as recipes
    from minifield.attempt.stopping import Stopping
    from minifield.attempt.update_loop import HostSnapshot, UpdateLoop, periodic_evaluation
    from minifield.state.arrays import named_arrays

    recipe = recipes.validate(
        linear_recipe(limits={"max_steps": 7}, checkpoint={"every_steps": 2, "keep": 9})
    )
    arrays, _ = recipe.strategy.prepare(recipe.data, {})
    reference_program = recipe.strategy.build(recipe.data, arrays)
    state = reference_program.init_state()
    expected = {}
    for step in range(1, 8):
        state, metrics = reference_program.step(state)
        expected[step] = (metrics["loss"], state_hash_by_hand(named_arrays(state)))

    program = recipe.strategy.build(recipe.data, arrays)
    events = EventLog(tmp_path / "events.jsonl", None)
    snapshot = HostSnapshot()
    checkpoints = _checkpointing(tmp_path, None)
    checkpoints.events, checkpoints.snapshot = events, snapshot
    commit_on_cadence, collect_commits = checkpoints.hooks()
    loop = UpdateLoop(
        program,
        max_steps=7,
        stopping=Stopping({}, stop_after_step=None, group=distributed.Group(), started_mono=0),
        events=events,
        progress=Progress(),
        hooks=[commit_on_cadence, periodic_evaluation(program, events, 7), collect_commits],
        record_state_hashes=3,
        say=lambda message: None,
        snapshot=snapshot,
    )
    end = loop.run(program.place(program.init_state()), 0, 0.0)
    checkpoints.ensure(end.state, end.step, end.compute_used)
    jax.block_until_ready(end.state)
    log = read_events(tmp_path / "events.jsonl")
    updates = [e for e in log if e["type"] == "update"]
    assert [e["step"] for e in updates] == list(range(1, 8))
    for event in updates:
        loss, state_hash = expected[event["step"]]
        assert event["loss"] == loss
        assert event.get("state_hash") == (state_hash if event["step"] % 3 == 0 else None)
    # a checkpoint is reported after its update, and carries the reference's state
    order = [(e["type"], e["step"]) for e in log]
    for e in log:
        if e["type"] == "checkpoint_committed":
            assert order.index(("update", e["step"])) < order.index((e["type"], e["step"]))
            assert e["state_hash"] == expected[e["step"]][1]
    assert sorted(e["step"] for e in log if e["type"] == "checkpoint_committed") == [2, 4, 6, 7]
    assert state_hash_by_hand(named_arrays(end.state)) == expected[7][1]


@pytest.fixture(scope="module")
def sft_space(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("disk_full")
    inputs = small_sft_inputs(tmp)
    # arrays of 128 × 512 float32 (256 KiB): above the file-size limit set below, which
    # the events, attempt.json and result.json of a few updates stay far under
    recipe = small_sft_recipe(
        inputs["pins"],
        "disk-full",
        1,
        model={"d_model": 128, "n_layers": 1, "n_heads": 2, "d_ff": 512},
        limits={"max_steps": 6},
    )
    return {"tmp": tmp, "input_root": inputs["input_root"], "recipe": write_recipe(
        tmp / "recipe.json", recipe)}  # fmt: skip


FILE_SIZE_LIMIT = 96 * 1024


@pytest.mark.slow
def test_a_full_disk_during_a_background_write_fails_the_attempt_naming_the_path(sft_space):
    """Checkpoint 2 is committed; then the worker's files may no longer grow past 96 KiB
    (as a full disk would refuse them), so checkpoint 4's background write fails: the
    attempt ends ``io_failed`` (exit 5: the output could not be written, resumable) with an
    error naming the file, checkpoint 4 is never reported or
    committed, checkpoint 2 is intact, and a resume from it repeats updates 3 and 4 bit for
    bit."""
    out = sft_space["tmp"] / "out"
    options = {
        "job": sft_space["recipe"],
        "input_root": sft_space["input_root"],
        "output_root": out,
        "record_state_hashes": True,
        # the resume loads the executables the first run compiled (its files predate the limit)
        "compilation_cache": sft_space["tmp"] / "jax-cache",
    }
    proc = subprocess.Popen(
        # hold still after update 3, so the limit lands between checkpoints 2 and 4
        worker_command(**options, attempt_id="full", stall_after_step=3, stall_seconds=3),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    attempt = out / "disk-full" / "full"
    limited = False
    for line in proc.stdout:
        event = json.loads(line)
        if event["type"] == "update" and event["step"] == 3:
            deadline = time.monotonic() + 2.5
            while not (attempt / "checkpoints/step-00000002/manifest.json").is_file():
                assert time.monotonic() < deadline, "checkpoint 2 was not committed in time"
                time.sleep(0.01)
            _, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
            resource.prlimit(proc.pid, resource.RLIMIT_FSIZE, (FILE_SIZE_LIMIT, hard))
            limited = True
    _, stderr = proc.communicate(timeout=300)
    assert limited
    assert proc.returncode == 5, stderr[-3000:]
    result = json.loads((attempt / "result.json").read_text())
    assert result["status"] == "io_failed" and result["error"]["phase"] == "checkpoint"
    message = result["error"]["message"]
    assert "checkpoint of step 4" in message and "File too large" in message
    assert str(attempt / "checkpoints" / ".tmp-step-00000004-") in message
    events = read_events(attempt / "events.jsonl")
    assert events[-1]["type"] == "failed" and events[-1]["message"] == message
    assert events[-1]["status"] == "io_failed"
    assert [e["step"] for e in events if e["type"] == "checkpoint_committed"] == [2]
    assert checkpoint.committed_steps(attempt / "checkpoints") == [2]
    assert not list((attempt / "checkpoints").glob(".tmp-*"))  # cleaned up after the error
    hashes = {e["step"]: e["state_hash"] for e in events if e["type"] == "update"}
    assert sorted(hashes) == list(range(1, max(hashes) + 1))  # every update computed, reported
    good = attempt / "checkpoints" / "step-00000002"
    assert verify_checkpoint_by_hand(good)[0]["state_hash"] == hashes[2]

    resumed = subprocess.run(
        worker_command(**options, attempt_id="resumed", resume_from=attempt),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    later = read_events(out / "disk-full" / "resumed" / "events.jsonl")
    assert [e["step"] for e in later if e["type"] == "restored"] == [2]
    again = {e["step"]: e["state_hash"] for e in later if e["type"] == "update"}
    assert sorted(again) == [3, 4, 5, 6]
    assert 4 in hashes and again[3] == hashes[3] and again[4] == hashes[4]


def test_whole_and_part_hashes_hashed_in_parallel_equal_the_hand_computed_ones():
    from minifield.state.arrays import hashes_of

    arrays = _flat(_state(3))
    whole, parts = hashes_of(arrays)
    assert whole == state_hash_by_hand(arrays)
    assert sorted(parts) == ["cursor", "opt_state", "params", "rng", "step"]
    for part, value in parts.items():
        assert value == state_hash_by_hand(
            {n: a for n, a in arrays.items() if n.split("/")[0] == part}
        )


def test_summary_counts_the_time_a_background_checkpoint_held_the_loop_up(tmp_path):
    """A background commit's ``seconds`` overlap the updates; the summary's checkpoint time is
    what it blocked (``blocking_seconds``), so the job's wall time is not counted twice."""
    from minifield.observe import summarize

    events = tmp_path / "events.jsonl"
    rows = [
        {"type": "attempt_started", "attempt_id": "a"},
        {"type": "update", "step": 1, "examples": 4, "tokens": 0, "seconds": 1.0},
        {"type": "update", "step": 2, "examples": 4, "tokens": 0, "seconds": 1.0},
        {"type": "update", "step": 3, "examples": 4, "tokens": 0, "seconds": 1.0},
        {"type": "checkpoint_committed", "step": 2, "seconds": 1.5, "blocking_seconds": 0.25},
        {"type": "completed", "steps": 3},
    ]
    events.write_text(
        "".join(
            json.dumps({"seq": i, **r, "time": 1000.0 + i, "mono": float(i)}) + "\n"
            for i, r in enumerate(rows)
        )
    )
    summary = summarize.summarize([events])
    assert summary["checkpoint_s"] == 0.25 and summary["committed_checkpoints_count"] == 1
