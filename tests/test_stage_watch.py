"""The benchmarks' watch over a stage's process (``benchmarks/_stage_watch.py``): a stage whose
host runs low on memory, or that runs past its time, is stopped with every process under it,
and the reason recorded; a stage that ends on its own is returned as it ended."""

from __future__ import annotations

import os
import sys
import time

import pytest
from conftest import REPO

sys.path.insert(0, str(REPO / "benchmarks"))
try:
    import _stage_watch
finally:
    sys.path.remove(str(REPO / "benchmarks"))

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not os.path.isfile("/proc/meminfo"), reason="needs Linux /proc"),
]

#: a stage that starts a process of its own (as the train stage starts the worker), prints the
#: grandchild's pid and waits
SPAWNING = (
    "import subprocess, sys, time; "
    "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)']); "
    "print(child.pid, flush=True); time.sleep(120)"
)


def _alive(pid: int) -> bool:
    try:
        stat = open(f"/proc/{pid}/stat").read()  # noqa: SIM115 - read at once
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"  # a zombie has ended


def test_a_stage_that_ends_returns_its_exit_output_and_the_lowest_available_memory():
    code, out, err, watch = _stage_watch.watched(
        [sys.executable, "-c", "import sys; print('done'); sys.exit(3)"], None, 0, 0
    )
    assert (code, out.strip()) == (3, "done") and "stopped" not in watch
    assert 0 < watch["available_min_bytes"] <= _stage_watch.available_bytes() * 2


@pytest.mark.parametrize("how", ["memory", "time"])
def test_a_stage_is_stopped_with_every_process_under_it(how):
    # memory: more available memory asked for than any host has; time: a 1 s limit
    min_available, limit = (1e18, 0) if how == "memory" else (0, 1.0)
    code, out, _, watch = _stage_watch.watched(
        [sys.executable, "-c", SPAWNING], None, min_available, limit
    )
    grandchild = int(out.split()[0])
    deadline = time.monotonic() + 5
    while _alive(grandchild) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(grandchild), "the stage's own process outlived it"
    assert code != 0
    assert ("available memory" if how == "memory" else "--stage-limit 1 s") in watch["stopped"]
    largest = watch["largest_processes"]
    sizes = [p["rss_bytes"] for p in largest]
    assert sizes and sizes == sorted(sizes, reverse=True)
