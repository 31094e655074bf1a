"""The one file lock (store writer, GPU leases, training lock) between real processes.

The reference for "held" is the kernel's: a raw ``fcntl.flock`` taken or tested
here, never the module's own view of itself.
"""

from __future__ import annotations

import fcntl
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from minifield.supervision import locks

# A holder: takes the lock, says so with its monotonic time, and releases it when told
# (a line on stdin) or when killed.
HOLDER = r"""
import sys, time
from minifield.supervision import locks
fd = locks.acquire(sys.argv[1], {"pid": __import__("os").getpid(), "who": "holder"},
                   timeout_s=30)
print("held", time.monotonic(), flush=True)
sys.stdin.readline()
released = time.monotonic()
__import__("os").close(fd)
print("released", released, flush=True)
time.sleep(30)
"""

# A waiter: waits for the lock without a time limit and reports when it got it.
WAITER = r"""
import sys, time
from minifield.supervision import locks
print("waiting", flush=True)
fd = locks.acquire(sys.argv[1], {"pid": __import__("os").getpid(), "who": "waiter"},
                   timeout_s=None, poll_s=0.01)
print("acquired", time.monotonic(), flush=True)
"""


def _start(script: str, path: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", script, str(path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )


def _line(proc: subprocess.Popen, word: str) -> float:
    line = proc.stdout.readline().split()
    assert line and line[0] == word, line
    return float(line[1]) if len(line) > 1 else 0.0


def _kernel_says_held(path: Path) -> bool:
    """Ask the kernel directly: can a fresh descriptor take the flock right now?"""
    with open(path, "a+") as handle:
        try:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(handle.fileno(), fcntl.LOCK_UN)
        return False


@pytest.fixture
def holder(tmp_path):
    path = tmp_path / "x.lock"
    proc = _start(HOLDER, path)
    _line(proc, "held")
    yield path, proc
    if proc.poll() is None:
        proc.kill()
    proc.wait(timeout=30)


@pytest.mark.slow  # holder and waiter are processes
def test_a_held_lock_excludes_other_processes_and_names_its_holder(holder):
    path, proc = holder
    assert _kernel_says_held(path)
    assert locks.try_lock(path, {"who": "test"}) is None
    with pytest.raises(locks.LockTimeout) as caught:
        locks.acquire(path, {"who": "test"}, timeout_s=0.2, poll_s=0.02)
    assert json.loads(caught.value.holder) == {"pid": proc.pid, "who": "holder"}
    assert str(proc.pid) in str(caught.value) and str(path) in str(caught.value)
    # The refused tries did not overwrite what the file says about its holder.
    assert json.loads(path.read_text()) == {"pid": proc.pid, "who": "holder"}


@pytest.mark.slow  # holder and waiter are processes
def test_a_waiter_gets_the_lock_only_after_the_holder_releases_it(holder):
    path, proc = holder
    waiter = _start(WAITER, path)
    try:
        _line(waiter, "waiting")
        time.sleep(0.3)  # the waiter polls meanwhile; it must not get the lock
        assert waiter.poll() is None
        proc.stdin.write("release\n")
        proc.stdin.flush()
        released = _line(proc, "released")
        acquired = _line(waiter, "acquired")
        assert acquired >= released  # CLOCK_MONOTONIC is shared by all processes
        assert waiter.wait(timeout=30) == 0
    finally:
        if waiter.poll() is None:
            waiter.kill()
            waiter.wait(timeout=30)


@pytest.mark.slow  # holder and waiter are processes
def test_a_killed_holder_releases_the_lock(holder):
    path, proc = holder
    waiter = _start(WAITER, path)
    try:
        _line(waiter, "waiting")
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        _line(waiter, "acquired")
        assert waiter.wait(timeout=30) == 0
    finally:
        if waiter.poll() is None:
            waiter.kill()
            waiter.wait(timeout=30)
    assert not _kernel_says_held(path)  # the waiter has exited too


def test_held_releases_on_exception_and_a_raw_flock_excludes_it(tmp_path):
    path = tmp_path / "y.lock"
    with pytest.raises(RuntimeError), locks.held(path, {"who": "test"}, timeout_s=1):
        assert _kernel_says_held(path)
        raise RuntimeError("boom")
    assert not _kernel_says_held(path)
    # A lock taken with a raw flock (another implementation) also keeps this one out.
    with open(path, "a+") as handle:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        assert locks.try_lock(path, {"who": "test"}) is None
    fd = locks.try_lock(path, {"who": "test"})
    assert fd is not None
    os.close(fd)
