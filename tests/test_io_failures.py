"""A full disk is an I/O failure, not a bad job: exit 5, ``io_failed``, resumable, files whole.

The disk fills at a chosen point in two real ways: a file-size limit (``RLIMIT_FSIZE``, set
for the worker process only; its writes past the limit get EFBIG) and a small tmpfs filled by
the test while the worker waits (ENOSPC; needs root to mount, skipped otherwise). Every
attempt is then resumed with room again and must reach the uninterrupted run's state hashes,
update by update.
"""

from __future__ import annotations

import errno
import json
import os
import resource
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import (
    linear_recipe,
    minifield_in_process,
    read_events,
    run_worker,
    worker_command,
    write_recipe,
)
from test_base_model import make_inputs
from test_lora import lora_recipe

from minifield import atomic
from minifield.attempt.events import EventLog

LINEAR_STEPS = 200  # about 140 KB of update events with state hashes
#: above the attempt's reserve (64 KiB), below what the events of LINEAR_STEPS updates take
EVENTS_LIMIT = 80 << 10


# -- in-process ----------------------------------------------------------------------------------


def _file_size_limit(limit: int):
    def apply() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails (EFBIG)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY))

    return apply


def test_an_event_that_does_not_fit_leaves_the_file_at_its_last_whole_line(tmp_path):
    path = tmp_path / "events.jsonl"
    log = EventLog(path, echo=None)
    log.emit("first", note="x")
    before = path.read_bytes()
    previous = resource.getrlimit(resource.RLIMIT_FSIZE)
    _file_size_limit(len(before) + 100)()  # the next line is cut after 100 bytes
    try:
        with pytest.raises(OSError) as raised:
            log.emit("second", note="y" * 1000)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, previous)
    assert raised.value.errno == errno.EFBIG and raised.value.filename == str(path)
    assert atomic.is_io_failure(raised.value)
    assert path.read_bytes() == before  # the 100 bytes written were taken back
    log.emit("third", durable=True)
    log.close()
    assert [(e["seq"], e["type"]) for e in read_events(path)] == [(0, "first"), (1, "third")]


def test_a_torn_last_line_is_cut_before_anything_is_appended(tmp_path):
    path = tmp_path / "events.jsonl"
    whole = b'{"seq": 0, "type": "a"}\n{"seq": 1, "type": "b"}\n'
    path.write_bytes(whole + b'{"seq": 2, "ty')  # a machine that went down mid-line
    log = EventLog(path, echo=None)
    log.emit("c")
    log.close()
    text = path.read_bytes()
    assert text.startswith(whole) and text.endswith(b"\n")
    assert [e["type"] for e in read_events(path)] == ["a", "b", "c"]


def test_io_failures_are_told_by_errno_through_wrapping_errors(tmp_path):
    def wrapped(code: int) -> Exception:
        try:
            try:
                raise OSError(code, os.strerror(code))
            except OSError as exc:
                raise RuntimeError("checkpoint of step 4 was not committed") from exc
        except RuntimeError as outer:
            return outer

    assert atomic.is_io_failure(wrapped(errno.ENOSPC))
    assert atomic.is_io_failure(wrapped(errno.EDQUOT))
    assert not atomic.is_io_failure(wrapped(errno.EACCES))  # a bad output root, not a full disk
    assert not atomic.is_io_failure(ValueError("x"))
    with pytest.raises(OSError) as raised, atomic.naming(tmp_path / "f"):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    assert raised.value.filename == str(tmp_path / "f")


# -- real workers --------------------------------------------------------------------------------


def _hashes(*attempts: Path) -> dict[int, str]:
    """Per-update state hashes along attempts (a later attempt's update replaces an earlier)."""
    return {
        e["step"]: e["state_hash"]
        for attempt in attempts
        for e in read_events(attempt / "events.jsonl")
        if e["type"] == "update"
    }


def _check_io_failed(attempt: Path, phase: str, *, ending_event: bool = True) -> dict:
    """What every I/O-failed attempt must look like; returns its result.json.

    ``ending_event=False``: the events file itself is what reached the limit, so the ``failed``
    event follows only if it is short enough to fit where the refused line was cut back (an
    update line's length varies with its timings); result.json (another file) says how the
    attempt ended either way."""
    raw = (attempt / "events.jsonl").read_bytes()
    assert raw.endswith(b"\n")
    events = [json.loads(line) for line in raw.splitlines()]  # every line whole
    assert [e["seq"] for e in events] == list(range(len(events)))
    result = json.loads((attempt / "result.json").read_text())
    assert result["status"] == "io_failed" and result["error"]["phase"] == phase
    assert str(attempt) in result["error"]["message"]  # names the file it could not write
    last, types = events[-1], [e["type"] for e in events]
    if ending_event or "failed" in types:  # the ending, once, last, as result.json says
        assert types.count("failed") == 1 and last["type"] == "failed"
        assert last["status"] == "io_failed"
        assert result["error"] == {"phase": last["phase"], "message": last["message"]}
    assert not (attempt / ".reserve").exists() and not (attempt / ".export.partial").exists()
    leftovers = [p.name for p in (attempt / "checkpoints").glob(".tmp-*")]
    assert leftovers == []
    return result


@pytest.fixture(scope="module")
def linear_job(tmp_path_factory):
    """A linear recipe of LINEAR_STEPS updates and its uninterrupted reference attempt."""
    root = tmp_path_factory.mktemp("linear")
    recipe = linear_recipe(
        limits={"max_steps": LINEAR_STEPS}, checkpoint={"every_steps": 50, "keep": 2}
    )
    job = write_recipe(root / "recipe.json", recipe)
    run_worker(
        job=job, input_root=root, output_root=root / "ref", record_state_hashes=True,
        check_codes=(0,),
    )  # fmt: skip
    (reference,) = (root / "ref" / "linear-test").iterdir()
    return job, reference


def _only_new(job_dir: Path, known: set[Path]) -> Path:
    (new,) = set(job_dir.iterdir()) - known
    return new


@pytest.mark.slow
def test_the_worker_at_a_file_size_limit_ends_io_failed_and_resumes_to_the_same_state(
    tmp_path, linear_job
):
    job, reference = linear_job
    out = tmp_path / "out"
    proc = subprocess.run(
        worker_command(job=job, input_root=tmp_path, output_root=out, record_state_hashes=True),
        capture_output=True, text=True, timeout=300, preexec_fn=_file_size_limit(EVENTS_LIMIT),
    )  # fmt: skip
    assert proc.returncode == 5, proc.stderr[-3000:]
    (attempt,) = (out / "linear-test").iterdir()
    result = _check_io_failed(attempt, "train", ending_event=False)
    assert "File too large" in result["error"]["message"]
    assert str(attempt / "events.jsonl") in result["error"]["message"]
    assert "io_failed" in proc.stderr and "Traceback" not in proc.stderr
    assert (attempt / "events.jsonl").stat().st_size <= EVENTS_LIMIT
    assert 50 <= result["checkpoint"]["step"] < LINEAR_STEPS

    run_worker(
        job=job, input_root=tmp_path, output_root=out, resume_from=attempt,
        record_state_hashes=True, check_codes=(0,),
    )  # fmt: skip
    resumed = _only_new(out / "linear-test", {attempt})
    done = json.loads((resumed / "result.json").read_text())
    expected = json.loads((reference / "result.json").read_text())
    assert done["final_state_hash"] == expected["final_state_hash"]
    assert _hashes(attempt, resumed) == _hashes(reference)


_API_SCRIPT = """
import json, sys
import minifield
result = minifield.run(sys.argv[1], input_root=sys.argv[2], output_root=sys.argv[3],
                       resume_from=sys.argv[4] or None, record_state_hashes=True)
print(json.dumps({"status": result.status, "exit_code": result.exit_code,
                  "attempt_dir": str(result.attempt_dir) if result.attempt_dir else None,
                  "error": result.error, "final_state_hash": result.final_state_hash}))
"""


def _api_run(job: Path, root: Path, out: Path, resume_from: Path | None = None, limit=None):
    proc = subprocess.run(
        [sys.executable, "-c", _API_SCRIPT, str(job), str(root), str(out), str(resume_from or "")],
        capture_output=True, text=True, timeout=300,
        preexec_fn=_file_size_limit(limit) if limit else None,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.splitlines()[-1])


@pytest.mark.slow
def test_the_api_reports_io_failed_with_the_attempt_directory(tmp_path, linear_job):
    job, reference = linear_job
    out = tmp_path / "out"
    failed = _api_run(job, tmp_path, out, limit=EVENTS_LIMIT)
    assert (failed["status"], failed["exit_code"]) == ("io_failed", 5)
    attempt = Path(failed["attempt_dir"])
    assert attempt.parent == out / "linear-test"
    assert failed["error"] == _check_io_failed(attempt, "train", ending_event=False)["error"]
    resumed = _api_run(job, tmp_path, out, resume_from=attempt)
    assert resumed["status"] == "completed"
    expected = json.loads((reference / "result.json").read_text())
    assert resumed["final_state_hash"] == expected["final_state_hash"]


@pytest.mark.slow
def test_a_failed_export_is_removed_named_and_resumed(tmp_path):
    """A LoRA run's checkpoint holds only the adapters and their moments (one data file per
    checkpoint), its export the merged full model: a file-size limit between the two fails
    the export alone."""
    make_inputs(tmp_path / "in")
    recipe = lora_recipe(tmp_path / "in")
    recipe["limits"]["max_steps"] = 2
    # no greedy generation in the evaluation: the export is the point (three workers each
    # compiled or loaded a generation program for one example)
    recipe["evaluation"].update({"max_generate_examples": 0, "export_dtype": "float32"})
    recipe["job_id"] = "llama-io"
    job = write_recipe(tmp_path / "recipe.json", recipe)
    common = {"job": job, "input_root": tmp_path / "in", "record_state_hashes": True}
    run_worker(output_root=tmp_path / "ref", check_codes=(0,), **common)
    (reference,) = (tmp_path / "ref" / "llama-io").iterdir()
    weights = reference / "export" / "model.safetensors"
    biggest_checkpoint_file = max(
        p.stat().st_size for p in (reference / "checkpoints").rglob("*") if p.is_file()
    )
    limit = (biggest_checkpoint_file + weights.stat().st_size) // 2
    assert biggest_checkpoint_file < limit < weights.stat().st_size  # the premise

    out = tmp_path / "out"
    proc = subprocess.run(
        worker_command(output_root=out, **common),
        capture_output=True, text=True, timeout=600, preexec_fn=_file_size_limit(limit),
    )  # fmt: skip
    assert proc.returncode == 5, proc.stderr[-3000:]
    (attempt,) = (out / "llama-io").iterdir()
    result = _check_io_failed(attempt, "export")
    message = result["error"]["message"]
    assert str(attempt / "export") in message and "model.safetensors" in message
    assert not (attempt / "export").exists()
    assert [p.name for p in attempt.iterdir() if "export" in p.name] == []
    assert result["checkpoint"]["step"] == 2  # the final state is committed: nothing is lost

    run_worker(output_root=out, resume_from=attempt, check_codes=(0,), **common)
    resumed = _only_new(out / "llama-io", {attempt})
    done = json.loads((resumed / "result.json").read_text())
    assert (
        done["final_state_hash"]
        == json.loads((reference / "result.json").read_text())["final_state_hash"]
    )
    assert (resumed / "export" / "model.safetensors").read_bytes() == weights.read_bytes()


# -- a real full disk (tmpfs) --------------------------------------------------------------------


@pytest.fixture
def small_disk(tmp_path):
    """An 8 MiB tmpfs (root only: skipped where it cannot be mounted), unmounted afterwards."""
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(disk)],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        yield disk
    finally:
        subprocess.run(["umount", str(disk)], check=True)


def _fill(disk: Path) -> Path:
    """Write a file until the disk refuses another byte; returns it (delete it to free)."""
    filler = disk / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        for size in (1 << 20, 4096, 1):
            try:
                while True:
                    os.write(fd, b"\0" * size)
            except OSError as exc:
                assert exc.errno == errno.ENOSPC
    finally:
        os.close(fd)
    return filler


@pytest.mark.slow
def test_a_disk_filled_during_training_ends_io_failed_and_resumes(tmp_path, small_disk, linear_job):
    job, reference = linear_job
    out = small_disk / "out"
    worker = subprocess.Popen(
        worker_command(
            job=job, input_root=tmp_path, output_root=out, record_state_hashes=True,
            stall_after_step=60, stall_seconds=15,
        ),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    for line in worker.stdout:  # the worker waits 15 s after update 60: fill the disk then
        event = json.loads(line)
        if event["type"] == "update" and event["step"] == 60:
            filler = _fill(small_disk)
            break
    worker.stdout.read()
    stderr = worker.stderr.read()
    assert worker.wait(timeout=300) == 5, stderr[-3000:]
    (attempt,) = (out / "linear-test").iterdir()
    result = _check_io_failed(attempt, "train")  # the reserve took the ending
    assert "No space left on device" in result["error"]["message"]
    assert result["checkpoint"]["step"] == 50

    filler.unlink()
    run_worker(
        job=job, input_root=tmp_path, output_root=out, resume_from=attempt,
        record_state_hashes=True, check_codes=(0,),
    )  # fmt: skip
    resumed = _only_new(out / "linear-test", {attempt})
    assert _hashes(attempt, resumed) == _hashes(reference)


@pytest.mark.slow
def test_no_attempt_is_opened_on_a_full_disk(tmp_path, small_disk, linear_job):
    job, _ = linear_job
    (small_disk / "out" / "linear-test").mkdir(parents=True)
    _fill(small_disk)
    proc = run_worker(job=job, input_root=tmp_path, output_root=small_disk / "out")
    assert proc.returncode == 5
    line = proc.stderr.strip().splitlines()[-1]
    assert line.startswith("minifield-worker: io_failed: cannot open an attempt under ")
    assert "No space left on device" in line and str(small_disk / "out" / "linear-test") in line
    assert list((small_disk / "out" / "linear-test").iterdir()) == []


def _store(store: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "minifield.cli", "store", "--store", str(store), *args],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip


def _store_here(store: Path, *args: str) -> subprocess.CompletedProcess:
    """``minifield store`` in this process, for what the test sets up and reads (the refusal
    under test is the real command, ``_store``)."""
    return minifield_in_process("store", "--store", store, *args)


@pytest.mark.slow
def test_a_store_on_a_full_disk_exits_5_and_stays_as_it_was(small_disk, linear_job):
    _, reference = linear_job
    store = small_disk / "store"
    first = _store_here(store, "publish", str(reference / "export"), "--no-proof", "first")
    assert first.returncode == 0, first.stderr
    listed = _store_here(store, "list").stdout
    assert len(json.loads(listed)) == 1  # the listing read back below holds the publication
    files = sorted(p.relative_to(store) for p in store.rglob("*"))
    filler = _fill(small_disk)

    second = _store(store, "publish", str(reference / "export"), "--no-proof", "second")
    assert second.returncode == 5, second.stderr
    (line,) = second.stderr.strip().splitlines()
    assert line.startswith("minifield store: publish: I/O failure: [Errno 28] No space left")
    assert str(store / "artifacts") in line and line.endswith("; nothing published")
    assert sorted(p.relative_to(store) for p in store.rglob("*")) == files
    filler.unlink()
    assert _store_here(store, "list").stdout == listed
