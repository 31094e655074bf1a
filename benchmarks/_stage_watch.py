"""A benchmark stage's process watched from its parent: the host's available memory read every
second, the stage stopped (its whole process tree) before the host runs out or when it runs past
its time, and why recorded (``benchmarks/qlora_pipeline.py``; docs/tpu.md: on the chip's host
an 8B stage that ran its memory out took the machine and every unwritten figure with it)."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

#: seconds between two readings of the host's available memory while a stage runs
WATCH_S = 1.0
#: seconds a stopped stage's processes have between SIGTERM and SIGKILL
GRACE_S = 10.0


def available_bytes() -> int | None:
    """The host's available memory (``MemAvailable``), or None where ``/proc`` has none."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _processes() -> dict[int, tuple[int, int, str]]:
    """``{pid: (parent pid, resident bytes, command)}`` of the processes ``/proc`` shows."""
    out = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            fields = stat[stat.rindex(")") + 2 :].split()
            command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except (OSError, ValueError):  # ended meanwhile
            continue
        out[int(entry.name)] = (int(fields[1]), int(fields[21]) * os.sysconf("SC_PAGE_SIZE"),
                                command.strip()[:160])  # fmt: skip
    return out


def _tree(pid: int, processes: dict) -> list[int]:
    """``pid`` and every process descended from it."""
    found, frontier = [pid], [pid]
    while frontier:
        frontier = [p for p, (parent, *_) in processes.items() if parent in frontier]
        found += frontier
    return found


def largest_processes(count: int = 5) -> list[dict]:
    biggest = sorted(_processes().items(), key=lambda item: -item[1][1])[:count]
    return [{"pid": pid, "rss_bytes": rss, "command": command}
            for pid, (_, rss, command) in biggest]  # fmt: skip


def _signal_tree(pid: int, sig: int) -> None:
    for each in reversed(_tree(pid, _processes())):
        try:
            os.kill(each, sig)
        except ProcessLookupError:
            pass


def watched(command: list[str], env, min_available: float, limit: float):
    """Run a stage's ``command``, reading the host's available memory every :data:`WATCH_S`
    seconds; under ``min_available`` bytes, or past ``limit`` seconds (either 0: never), the
    stage's process and every process under it are stopped (SIGTERM, then SIGKILL after
    :data:`GRACE_S`), before the host runs out (on the chip's host that takes the machine, and
    every figure not yet written, with it). Returns ``(exit, stdout, stderr, watch)``, the
    ``watch`` holding the lowest available memory seen and, when stopped, why and the largest
    processes then."""
    began = time.monotonic()
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env)  # fmt: skip
    watch: dict = {"available_min_bytes": available_bytes()}
    stopped_at = None
    while True:
        try:
            out, err = proc.communicate(timeout=WATCH_S)
            return proc.returncode, out, err, watch
        except subprocess.TimeoutExpired:
            pass
        available = available_bytes()
        if available is not None:
            watch["available_min_bytes"] = min(watch["available_min_bytes"], available)
        if stopped_at is None:
            if min_available and available is not None and available < min_available:
                watch["stopped"] = (f"the host's available memory {available / 1e9:.1f} GB fell "
                                    f"under --min-available-gb {min_available / 1e9:g}")  # fmt: skip
            elif limit and time.monotonic() - began > limit:
                watch["stopped"] = f"it ran past --stage-limit {limit:g} s"
            if "stopped" in watch:
                watch["largest_processes"] = largest_processes()
                _signal_tree(proc.pid, signal.SIGTERM)
                stopped_at = time.monotonic()
        elif time.monotonic() - stopped_at > GRACE_S:
            _signal_tree(proc.pid, signal.SIGKILL)
