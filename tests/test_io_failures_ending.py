"""An I/O failure met while the attempt is already ending still ends in a ``result.json``.

When the events file is what filled (``RLIMIT_FSIZE``, a full disk), whatever the attempt
still has to say while handling that failure is refused too: the report of a checkpoint
committed in the background but not yet reported, a ``diverged`` event; and a failing device
may refuse even the removal of the attempt's ``.reserve``. Such a refusal once
escaped the failure handling: the worker exited 5 with no ``result.json`` (and its
``.reserve`` left behind), the error misreported as "cannot open an attempt". These tests
put the failure exactly there, not by timing.
"""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import test_io_failures
from conftest import linear_recipe, read_events, run_worker, worker_args, write_recipe
from test_divergence import _diverging_recipe
from test_io_failures import _check_io_failed, _hashes, _only_new

import minifield
from minifield.attempt import setup as attempt_setup
from minifield.attempt.events import EventLog

#: the linear job of LINEAR_STEPS updates and its reference attempt (built once in this module)
linear_job = test_io_failures.linear_job


def test_a_divergence_met_on_a_full_events_file_still_ends_in_a_result(tmp_path, monkeypatch):
    """The ``diverged`` event is refused (the events file is full from there on): the attempt
    still ends with a result.json, io_failed (its ending could not be recorded) and naming the
    divergence; the refused event once escaped the failure handling and left none.

    In-process, the full file is a refusal of every append from that event on (the EFBIG an
    append at ``RLIMIT_FSIZE`` gets): a real limit would hit this test process's own files."""
    append, full = EventLog._append, []

    def filling(self, data: bytes) -> None:
        if b'"type": "diverged"' in data:
            full.append(self.path)
        if full:
            raise OSError(errno.EFBIG, os.strerror(errno.EFBIG), str(self.path))
        append(self, data)

    monkeypatch.setattr(EventLog, "_append", filling)
    recipe = _diverging_recipe(tmp_path / "in")
    run = minifield.run(recipe, input_root=tmp_path / "in", output_root=tmp_path / "out")
    assert (run.status, run.exit_code) == ("io_failed", 5) and full
    assert run.attempt_dir is not None, run.error  # not "cannot open an attempt"
    attempt = Path(run.attempt_dir)
    result = json.loads((attempt / "result.json").read_text())
    assert result["status"] == "io_failed" and run.error == result["error"]
    assert result["error"]["phase"] == "finish"
    message = result["error"]["message"]
    assert message.startswith("the failed ending (diverged: update ")
    assert message.endswith(f"was not recorded: [Errno 27] File too large: '{full[0]}'")
    events = read_events(attempt / "events.jsonl")
    assert events[-1]["type"] in ("update", "checkpoint_committed")
    assert result["checkpoint"]["step"] == max(
        e["step"] for e in events if e["type"] == "checkpoint_committed"
    )
    assert not (attempt / ".reserve").exists()


def test_a_reserve_that_cannot_be_given_back_still_ends_in_a_result(tmp_path, monkeypatch, capsys):
    """Giving the reserve back is the first of the last words: a failing device that refuses
    it (EIO) is said, and result.json is still written (the error once escaped _finish)."""

    def refused(directory: Path) -> None:
        raise OSError(errno.EIO, os.strerror(errno.EIO), str(directory / ".reserve"))

    monkeypatch.setattr(attempt_setup, "release_reserve", refused)
    job = write_recipe(tmp_path / "recipe.json", linear_recipe())
    run = minifield.run(job, input_root=tmp_path, output_root=tmp_path / "out")
    assert (run.status, run.exit_code) == ("completed", 0)
    assert json.loads((Path(run.attempt_dir) / "result.json").read_text())["status"] == "completed"
    assert "the reserve was not given back: [Errno 5] Input/output error" in capsys.readouterr().err


#: the worker, with the events file filled at update STEP while the background write of the
#: checkpoint before it is held back until then: when the attempt settles that write, its
#: ``checkpoint_committed`` event meets a full events file (the path a loaded machine took)
_FULL_AT_A_PENDING_COMMIT = """
import os, resource, signal, sys, threading
from minifield import worker
from minifield.attempt import checkpoint_writer, events

step, gate = int(sys.argv[1]), threading.Event()
emit, submit = events.EventLog.emit, checkpoint_writer.BackgroundWriter.submit

def held_submit(self, write):
    commit = write.commit
    def held():
        gate.wait()  # committed once the events file is full, never reported before
        return commit()
    if write.step == step - 1:
        write.commit = held
    submit(self, write)

def filling_emit(self, type_, **fields):
    if type_ == "update" and fields["step"] == step:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        size = os.fstat(self._fd).st_size  # not one more byte of events: this line is refused
        resource.setrlimit(resource.RLIMIT_FSIZE, (size, resource.RLIM_INFINITY))
        gate.set()
    return emit(self, type_, **fields)

checkpoint_writer.BackgroundWriter.submit = held_submit
events.EventLog.emit = filling_emit
sys.exit(worker.main(sys.argv[2:]))
"""


@pytest.mark.slow
def test_an_events_file_full_while_a_checkpoint_commit_is_unreported_still_ends_in_a_result(
    tmp_path, linear_job
):
    """The events file fills at update 101 while checkpoint 100 is committed in the background
    but not yet reported: its ``checkpoint_committed`` event cannot be written when the
    attempt settles the write, and the attempt must still end io_failed with a result.json
    (it once left none: the refused event escaped the failure handling)."""
    job, reference = linear_job
    out = tmp_path / "out"
    args = worker_args(job=job, input_root=tmp_path, output_root=out, record_state_hashes=True)
    proc = subprocess.run(
        [sys.executable, "-c", _FULL_AT_A_PENDING_COMMIT, "101", *args],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 5, proc.stderr[-3000:]
    (attempt,) = (out / "linear-test").iterdir()
    result = _check_io_failed(attempt, "train", ending_event=False)
    assert "File too large" in result["error"]["message"]
    assert str(attempt / "events.jsonl") in result["error"]["message"]
    assert "Traceback" not in proc.stderr
    types = [(e["type"], e.get("step")) for e in read_events(attempt / "events.jsonl")]
    # the last update written is 100 (an earlier checkpoint's event may land after it when
    # that commit ends late, on a loaded machine), and checkpoint 100's event is not there
    assert [s for t, s in types if t == "update"][-1] == 100
    assert max(s for _, s in types if s is not None) == 100
    assert ("checkpoint_committed", 100) not in types
    # checkpoint 100 is committed, its event refused: result.json names it all the same
    assert result["checkpoint"]["step"] == 100
    # the event that was not written is said, and which checkpoint counts
    assert "a checkpoint's event was not written" in proc.stderr
    assert f"the newest committed checkpoint is {result['checkpoint']['path']}" in proc.stderr

    run_worker(
        job=job, input_root=tmp_path, output_root=out, resume_from=attempt,
        record_state_hashes=True, check_codes=(0,),
    )  # fmt: skip
    resumed = _only_new(out / "linear-test", {attempt})
    assert _hashes(attempt, resumed) == _hashes(reference)
