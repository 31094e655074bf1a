"""Stopping before an update: the vote's precedence, the limits, and a closed event stream."""

from __future__ import annotations

import io
import json
import os
import signal
import time

from minifield.attempt.events import EventLog, write_line
from minifield.attempt.stopping import LimitReached, Preempt, Stopping, limit_reason
from minifield.supervision import distributed


def _stopping(limits=None, stop_after_step=None) -> Stopping:
    return Stopping(
        limits or {},
        stop_after_step=stop_after_step,
        group=distributed.Group(),
        started_mono=time.monotonic(),
    )


def test_limits_each_name_themselves():
    now = time.monotonic()
    assert limit_reason({}, stop_after_step=None, step=5, started_mono=now, compute_used=9) is None
    assert "stop_after_step=5" in limit_reason(
        {}, stop_after_step=5, step=5, started_mono=now, compute_used=0
    )
    assert "deadline 2000-01-01T00:00:00Z" in limit_reason(
        {"deadline": "2000-01-01T00:00:00Z"},
        stop_after_step=None,
        step=0,
        started_mono=now,
        compute_used=0,
    )
    assert (
        limit_reason(
            {"deadline": "2999-01-01T00:00:00+00:00"},
            stop_after_step=None,
            step=0,
            started_mono=now,
            compute_used=0,
        )
        is None
    )
    assert "max_wall_seconds=10" in limit_reason(
        {"max_wall_seconds": 10},
        stop_after_step=None,
        step=0,
        started_mono=now - 11,
        compute_used=0,
    )
    assert "max_compute_seconds=2 used (2.500 s)" in limit_reason(
        {"max_compute_seconds": 2}, stop_after_step=None, step=0, started_mono=now, compute_used=2.5
    )


def test_a_signal_outranks_a_closed_stream_which_outranks_a_limit():
    stopping = _stopping(stop_after_step=3)
    assert stopping.before_update(step=2, compute_used=0) is None
    assert stopping.before_update(step=3, compute_used=0) == LimitReached(
        "stop_after_step=3 reached (operational step limit)"
    )
    stopping.preemption.reader_gone("stdout closed (its reader went away)")
    assert stopping.before_update(step=3, compute_used=0) == Preempt(
        reason="stdout closed (its reader went away)", signal=None
    )
    stopping.preemption.install()
    try:
        os.kill(os.getpid(), signal.SIGTERM)  # only sets the flag
        assert stopping.before_update(step=3, compute_used=0) == Preempt(
            reason="signal SIGTERM", signal="SIGTERM"
        )
    finally:
        stopping.preemption.restore()


def test_a_pipe_whose_reader_went_away_is_detached_quietly(tmp_path):
    read_end, write_end = os.pipe()
    stream = os.fdopen(write_end, "w")
    assert write_line(stream, "first") is None
    assert os.read(read_end, 100) == b"first\n"
    os.close(read_end)
    assert write_line(stream, "second") == "closed (its reader went away)"
    # the descriptor now points at /dev/null: later writes and the final flush succeed
    assert os.fstat(stream.fileno()).st_rdev == os.stat(os.devnull).st_rdev
    assert write_line(stream, "third") is None
    stream.close()

    # an echo without a descriptor is dropped as well
    class Broken(io.StringIO):
        def write(self, text):
            raise BrokenPipeError(32, "Broken pipe")

    assert write_line(Broken(), "x") == "closed (its reader went away)"


def test_the_event_log_goes_on_when_its_echo_closes(tmp_path):
    read_end, write_end = os.pipe()
    echo = os.fdopen(write_end, "w")
    closed = []
    log = EventLog(tmp_path / "events.jsonl", echo=echo, on_echo_closed=closed.append)
    log.emit("one")
    os.close(read_end)
    log.emit("two")
    log.emit("three")
    log.close()
    echo.close()
    assert closed == ["stdout closed (its reader went away)"]  # told once
    lines = (tmp_path / "events.jsonl").read_text().splitlines()
    assert [json.loads(line)["type"] for line in lines] == ["one", "two", "three"]
