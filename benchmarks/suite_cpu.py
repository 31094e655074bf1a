"""Where the test suite's CPU goes, process by process: every Python process the run starts
records its own CPU time when it exits, with the test that started it, and the totals are
printed by kind of process (the pytest workers' in-process tests, minifield workers,
Snakemake, its job scripts, ...) and by test file.

Each process is counted once (its own user + system time, not its children's). The record is
written by a ``sitecustomize`` module put first on ``PYTHONPATH`` for this run only, which
every started Python process inherits (tests start theirs from ``os.environ``); the test is
``PYTEST_CURRENT_TEST``, which pytest sets in its environment while a test runs, so a started
process names the test that started it. Not counted: processes killed by a signal (they run
no exit hook), and what is not Python (a SLURM daemon, git, the kernel's own work):
``Not accounted`` is the difference from the run's whole CPU.

    uv run --locked python benchmarks/suite_cpu.py [--json FILE] [-- PYTEST ARGS]
    uv run --locked python benchmarks/suite_cpu.py -- -m "not slow"
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

#: the exit hook each process runs: its own CPU, its argv and the test that started it
SITECUSTOMIZE = """\
import atexit, json, os, resource, sys, time

_STARTED = time.monotonic()


def _record():
    usage = resource.getrusage(resource.RUSAGE_SELF)
    line = {
        "argv": sys.argv[:4],
        "cpu": usage.ru_utime + usage.ru_stime,
        "wall": time.monotonic() - _STARTED,
        "test": os.environ.get("PYTEST_CURRENT_TEST", "").split(" ")[0],
        "xdist": os.environ.get("PYTEST_XDIST_WORKER", ""),
    }
    try:
        with open(os.environ["MINIFIELD_SUITE_CPU_LOG"], "a", encoding="utf-8") as log:
            log.write(json.dumps(line) + "\\n")
    except OSError:
        pass


atexit.register(_record)
"""


def kind(row: dict) -> str:
    """What a recorded process was."""
    argv = row["argv"] or [""]
    first = argv[0]
    if row["xdist"] and not row["test"] and first == "-c":
        return "pytest workers (in-process tests)"
    if first.endswith("pytest/__main__.py"):
        return "pytest (the session)"
    if first.endswith("snakemake/__main__.py"):  # python -m snakemake: argv[0] is its path
        return "snakemake"
    if first == "-m" and len(argv) > 1:
        return f"-m {argv[1]}"
    if "/.snakemake/scripts/" in first:
        return "snakemake job scripts"
    if first.endswith("minifield/worker.py"):
        return "minifield workers"
    if first == "-c":
        return "python -c (probes, recomputations)"
    return Path(first).name or "?"


def report(rows: list[dict], total_cpu: float, wall: float) -> str:
    by_kind, starts = collections.Counter(), collections.Counter()
    by_file = collections.Counter()
    for row in rows:
        by_kind[kind(row)] += row["cpu"]
        starts[kind(row)] += 1
        if row["test"]:
            by_file[row["test"].split("::")[0]] += row["cpu"]
    counted = sum(by_kind.values())
    lines = [f"wall {wall:.0f} s, CPU {total_cpu:.0f} s ({total_cpu / wall:.2f} cores busy)",
             "", "CPU-s   processes  kind"]  # fmt: skip
    lines += [f"{cpu:7.1f} {starts[name]:6d}     {name}" for name, cpu in by_kind.most_common()]
    lines += [f"{total_cpu - counted:7.1f}            not accounted (non-Python, killed)", ""]
    lines += ["CPU-s of the processes each test file started"]
    lines += [f"{cpu:7.1f}  {name}" for name, cpu in by_file.most_common(25)]
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", help="write every process's record here")
    parser.add_argument("pytest_args", nargs="*", help="after --: pytest's arguments")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="suite-cpu-") as hook:
        Path(hook, "sitecustomize.py").write_text(SITECUSTOMIZE, encoding="utf-8")
        log = Path(hook, "processes.jsonl")
        path = os.pathsep.join(filter(None, [hook, os.environ.get("PYTHONPATH")]))
        env = {**os.environ, "PYTHONPATH": path, "MINIFIELD_SUITE_CPU_LOG": str(log)}
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        started = time.monotonic()
        code = subprocess.call([sys.executable, "-m", "pytest", *args.pytest_args], env=env)
        wall = time.monotonic() - started
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        total = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
        rows = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    print(report(rows, total, wall))
    if args.json:
        Path(args.json).write_text(json.dumps(rows), encoding="utf-8")
    return code


if __name__ == "__main__":
    raise SystemExit(main())
