"""A section's process and the processes it starts: run one within its time limit, stop the
whole tree (a proof's workers run in sessions of their own) when it is out of time."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from pathlib import Path

from device_check.settings import PACKAGE, REPO

INTERRUPTED = threading.Event()  # set by SIGINT/SIGTERM in the parent


def _echo(stream, tail: deque) -> None:
    for line in iter(stream.readline, ""):
        sys.stderr.write(line)
        sys.stderr.flush()
        tail.append(line.rstrip("\n"))


def _processes() -> dict[int, tuple[int, int]]:
    """pid -> (parent pid, start time) of every process (Linux ``/proc``; elsewhere none)."""
    found = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            found[int(stat.parent.name)] = (int(fields[1]), int(fields[19]))
        except (OSError, IndexError, ValueError):
            continue
    return found


def _tree(pid: int) -> dict[int, int]:
    """``pid`` and every process below it, each with its start time (which tells a process
    from a later one that reuses its id). The section's process starts workers in sessions of
    their own, which a signal to its process group would not reach."""
    table = _processes()
    found = {pid: table[pid][1]} if pid in table else {}
    todo = [pid]
    while todo:
        parent = todo.pop()
        for child, (ppid, start) in table.items():
            if ppid == parent and child not in found:
                found[child] = start
                todo.append(child)
    return found


def _signal_tree(tree: dict[int, int], sig: int) -> None:
    table = _processes()
    for pid, start in tree.items():
        if table.get(pid, (None, None))[1] == start:  # still the process we saw
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)


def _stop(child: subprocess.Popen) -> None:
    """End a section's process and everything it started: SIGTERM (a worker commits a
    checkpoint and exits), then SIGKILL to whatever is left after 10 s."""
    tree = _tree(child.pid)
    _signal_tree(tree, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        child.wait(10)
    _signal_tree({**tree, **_tree(child.pid)}, signal.SIGKILL)
    child.wait()


def run_section(args, name: str, limit: float, context_path: Path, record, env: dict) -> dict:
    """Run section ``name`` in a child process within ``limit`` seconds; its result (or what
    it had when it failed or ran out of time) with ``status`` and ``seconds``. ``record(name,
    partial)`` receives its partial results while it runs."""
    section_out = Path(args.work_dir) / f"section-{name}.json"
    section_out.unlink(missing_ok=True)
    command = [
        sys.executable, str(PACKAGE), *args.passthrough,
        "--section", name, "--section-out", str(section_out), "--context", str(context_path),
        "--deadline", repr(time.time() + limit - 5.0), "--work-dir", str(args.work_dir),
    ]  # fmt: skip
    started = time.monotonic()
    tail: deque = deque(maxlen=40)
    child = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        cwd=REPO,
        start_new_session=True,  # a signal at the terminal reaches the parent only
    )
    reader = threading.Thread(target=_echo, args=(child.stdout, tail), daemon=True)
    reader.start()
    timed_out, seen = False, None
    try:
        while True:
            # the limit first: a section given 0 s is out of time however fast it is
            if time.monotonic() - started >= limit or INTERRUPTED.is_set():
                timed_out = True
                _stop(child)
                break
            try:
                child.wait(0.25)
                break
            except subprocess.TimeoutExpired:
                pass
            try:  # partial results land in the JSON as they come
                stamp = section_out.stat().st_mtime_ns
                if stamp != seen:
                    seen = stamp
                    record(name, json.loads(section_out.read_text()))
            except (OSError, json.JSONDecodeError):
                pass
    except BaseException:  # the child is in a session of its own: end it with the parent
        _stop(child)
        raise
    reader.join(5)
    seconds = time.monotonic() - started
    try:
        result = json.loads(section_out.read_text())
    except (OSError, json.JSONDecodeError):
        result = {}
    if timed_out and INTERRUPTED.is_set():
        result.update(status="interrupted", error="the check was interrupted (SIGINT/SIGTERM)")
    elif timed_out:
        result.update(status="timeout", error=f"no result within the {limit:.0f} s limit")
    elif child.returncode != 0 and result.get("status") != "failed":
        result.update(
            status="failed",
            error=f"the section's process exited with {child.returncode} "
            f"(a negative code is the signal that ended it)",
        )
    elif result.get("status") not in ("ok", "failed"):
        result.update(status="failed", error="the section's process wrote no result")
    if result["status"] != "ok":
        result["output_tail"] = list(tail)
    result["seconds"] = seconds
    result["limit_s"] = limit
    return result
