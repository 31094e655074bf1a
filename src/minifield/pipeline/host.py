"""What the host running Snakemake may lack, made good before any job starts.

Snakemake's ``benchmark:`` files (each job's time, memory and I/O) read every job process's
I/O counters through psutil, and treat ``NotImplementedError`` as "this system keeps no I/O
accounting". In a gVisor sandbox (the TPU host this project is measured on) ``/proc/<pid>/io``
exists but lacks ``rchar``, so psutil raises ``ValueError`` and Snakemake fails the job. There
the counters are said to be missing, as on a system without them: the benchmark files then
hold time and memory, and zero I/O.
"""

from __future__ import annotations

import functools


def io_counters_readable(process=None) -> bool:
    """Whether psutil reads this process's I/O counters (False where /proc/<pid>/io is partial)."""
    import psutil

    try:
        (process or psutil.Process()).io_counters()
    except ValueError:
        return False
    except (NotImplementedError, AttributeError, psutil.Error):
        return True  # no accounting, or none to read: what Snakemake already handles
    return True


def io_counters_as_missing_where_partial() -> bool:
    """Where psutil cannot parse the I/O counters, make them raise ``NotImplementedError``
    (Snakemake then benchmarks without I/O). Returns whether it did."""
    import psutil

    if io_counters_readable() or getattr(psutil.Process.io_counters, "_partial", False):
        return False
    original = psutil.Process.io_counters

    @functools.wraps(original)
    def io_counters(self):
        try:
            return original(self)
        except ValueError as exc:
            raise NotImplementedError(f"I/O counters unreadable here: {exc}") from exc

    io_counters._partial = True
    psutil.Process.io_counters = io_counters
    return True
