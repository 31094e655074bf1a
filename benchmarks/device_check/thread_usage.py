"""Where a measured call's CPU went, thread by thread: its user and system seconds, and each
thread's by name, read from ``/proc`` while it runs (Linux; the process's totals elsewhere).

The checkpoint section's commits of a fresh host copy on the chip cost three times the CPU of
the same commit made again (docs/tpu.md, "Checkpoints on the chip"); this tells the commit's
own threads (the hashing pool, its lane, the writer) from the runtime's.
"""

from __future__ import annotations

import os
import re
import resource
from pathlib import Path

#: a thread's CPU below this is left out of ``usage``'s list
_THREAD_MIN_S = 0.05
#: seconds between two readings of the threads' CPU in ``usage``
_SAMPLE_S = 0.01


def _threads() -> dict[int, tuple[str, float, float]]:
    """``{thread id: (name, user s, system s)}`` of this process's threads now (Linux's
    ``/proc``; empty elsewhere)."""
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    out = {}
    tasks = Path("/proc/self/task")
    for task in tasks.iterdir() if tasks.is_dir() else ():
        try:
            stat = (task / "stat").read_text()
        except OSError:  # ended since the listing
            continue
        fields = stat[stat.rindex(")") + 2 :].split()  # from field 3, the state
        name = stat[stat.index("(") + 1 : stat.rindex(")")]
        out[int(task.name)] = (name, int(fields[11]) / tick, int(fields[12]) / tick)
    return out


def usage(measure):
    """(``measure()``'s result, where its CPU went): this process's user and system seconds,
    minor faults and context switches over the call, and the CPU of each thread by its
    Python name (numbered pool threads as one; a thread JAX's runtime started by its system
    name), read every :data:`_SAMPLE_S` seconds so that the threads the call starts and ends
    are counted up to their last reading (``unsampled_s``: what no reading saw)."""
    import threading

    seen: dict[int, tuple[str, float, float]] = {}
    names: dict[int, str] = {}
    done = threading.Event()

    def sample() -> None:
        while True:
            names.update((t.native_id, t.name) for t in threading.enumerate() if t.native_id)
            seen.update(_threads())
            if done.wait(_SAMPLE_S):
                return

    before, rusage = _threads(), resource.getrusage(resource.RUSAGE_SELF)
    sampler = threading.Thread(target=sample, name="usage-sampler", daemon=True)
    sampler.start()
    try:
        result = measure()
    finally:
        done.set()
        sampler.join()
    seen.update(_threads())
    end = resource.getrusage(resource.RUSAGE_SELF)
    by_name: dict[str, list[float]] = {}
    for tid, (name, user, system) in seen.items():
        key = re.sub(r"[-_:]?\d+(_\d+)?$", "", names.get(tid, name))
        spent = by_name.setdefault(key, [0.0, 0.0])
        spent[0] += user - before.get(tid, (name, 0.0, 0.0))[1]
        spent[1] += system - before.get(tid, (name, 0.0, 0.0))[2]
    user, system = end.ru_utime - rusage.ru_utime, end.ru_stime - rusage.ru_stime
    return result, {
        "user_s": user, "sys_s": system, "minor_faults": end.ru_minflt - rusage.ru_minflt,
        "voluntary_switches": end.ru_nvcsw - rusage.ru_nvcsw,
        "involuntary_switches": end.ru_nivcsw - rusage.ru_nivcsw,
        "unsampled_s": user + system - sum(u + s for u, s in by_name.values()),
        "threads": {n: [round(u, 2), round(s, 2)] for n, (u, s) in sorted(by_name.items())
                    if u + s >= _THREAD_MIN_S},
    }  # fmt: skip
