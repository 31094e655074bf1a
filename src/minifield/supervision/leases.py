"""GPU slots: exclusive leases through lock files, so concurrent jobs never share a GPU.

Each GPU id has a lock file ``<lease_dir>/gpu-<id>.lock``. A job leases a slot by
taking its lock (:mod:`minifield.supervision.locks`: non-blocking, trying each slot in turn,
waiting and retrying while all are busy, all or nothing). A lock ends however its
holder ends — normal exit, exception, SIGKILL. The descriptors are also handed to
the supervised child (``pass_fds``), so the slot stays taken as long as the child
runs, even if the supervising process itself dies first.

The child sees only its slot(s) through ``CUDA_VISIBLE_DEVICES``. With no GPU
(no ``nvidia-smi``, or ``gpus: []`` in the config) leasing is a no-op.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from . import locks

_GPU_LINE = re.compile(r"^GPU (\d+):")


class LeaseError(Exception):
    """No slot could be leased (bad request, or none free before the wait ran out)."""


def detect_gpus() -> list[str]:
    """GPU indices reported by ``nvidia-smi -L`` (empty when there is none)."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return []
    try:
        out = subprocess.run([exe, "-L"], capture_output=True, text=True, timeout=20, check=False)
    except (OSError, subprocess.SubprocessError):
        return []
    if out.returncode != 0:
        return []
    return [m.group(1) for line in out.stdout.splitlines() if (m := _GPU_LINE.match(line.strip()))]


def visible_gpus(configured: Sequence[str | int] | None) -> list[str]:
    """The GPU ids to lease from: the configured list if given, else what ``nvidia-smi`` sees."""
    if configured is not None:
        return [str(g) for g in configured]
    return detect_gpus()


@dataclass
class Lease:
    gpus: list[str]
    lock_files: list[Path] = field(default_factory=list)
    fds: list[int] = field(default_factory=list)
    waited_s: float = 0.0

    def env(self, base: Mapping[str, str]) -> dict[str, str]:
        """``base`` with ``CUDA_VISIBLE_DEVICES`` limited to the leased GPUs (unchanged if none)."""
        env = dict(base)
        if self.gpus:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(self.gpus)
        return env

    def record(self) -> dict:
        return {
            "gpus": self.gpus,
            "lock_files": [str(p) for p in self.lock_files],
            "waited_s": self.waited_s,
        }

    def release(self) -> None:
        for fd in self.fds:
            try:
                os.close(fd)
            except OSError:
                pass
        self.fds = []


def acquire(
    lease_dir: Path,
    gpus: Sequence[str],
    count: int = 1,
    *,
    wait_s: float = 3600.0,
    poll_s: float = 0.2,
    holder: Mapping[str, object] | None = None,
) -> Lease:
    """Lease ``count`` of ``gpus`` exclusively; waits up to ``wait_s`` for free slots."""
    if not gpus:
        return Lease(gpus=[])
    if count < 1 or count > len(gpus):
        raise LeaseError(
            f"cannot lease {count} GPU(s): {len(gpus)} slot(s) configured ({list(gpus)})"
        )
    lease_dir = Path(lease_dir)
    lease_dir.mkdir(parents=True, exist_ok=True)
    info = {"pid": os.getpid(), "since": time.time(), **(holder or {})}
    started = time.monotonic()
    while True:
        taken: list[tuple[str, Path, int]] = []
        for gpu in gpus:
            path = lease_dir / f"gpu-{gpu}.lock"
            fd = locks.try_lock(path, info)
            if fd is not None:
                taken.append((gpu, path, fd))
                if len(taken) == count:
                    break
        if len(taken) == count:
            for _, _, fd in taken:
                os.set_inheritable(fd, True)
            return Lease(
                gpus=[g for g, _, _ in taken],
                lock_files=[p for _, p, _ in taken],
                fds=[fd for _, _, fd in taken],
                waited_s=time.monotonic() - started,
            )
        for _, _, fd in taken:  # all or nothing, so two jobs never deadlock on half a set
            os.close(fd)
        if time.monotonic() - started >= wait_s:
            raise LeaseError(
                f"no {count} free GPU slot(s) among {list(gpus)} in {lease_dir} after {wait_s:.0f} s"
            )
        time.sleep(poll_s)


@contextmanager
def lease(
    lease_dir: Path,
    gpus: Sequence[str],
    count: int = 1,
    **kwargs,
) -> Iterator[Lease]:
    """Context manager around :func:`acquire`; the slots are released on any exit."""
    held = acquire(lease_dir, gpus, count, **kwargs)
    try:
        yield held
    finally:
        held.release()
