"""Probe processes joined on loopback: JAX's distributed runtime on 127.0.0.1 through
``MINIFIELD_COORDINATOR`` / ``MINIFIELD_NUM_PROCESSES`` / ``MINIFIELD_PROCESS_ID``, each with
its own forced number of CPU devices (used by the multi-process probe tests)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys


def cpu_env(devices: int, extra: dict | None = None) -> dict:
    """This environment on the CPU backend with ``devices`` forced host devices (and the other
    flags the session gives the processes it starts: tests/conftest.py)."""
    count = "--xla_force_host_platform_device_count"
    kept = [f for f in os.environ.get("XLA_FLAGS", "").split() if not f.startswith(count)]
    return {
        **os.environ,
        "JAX_PLATFORMS": "cpu",
        "XLA_FLAGS": " ".join([f"{count}={devices}", *kept]),
        **(extra or {}),
    }


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_processes(argv: list[str], count: int, devices_each: int, timeout: int = 240) -> dict:
    """Process 0's report (its last stdout line, JSON) of ``count`` processes of the Python
    script ``argv`` joined on loopback; each must exit 0."""
    return json.loads(run_all(argv, count, devices_each, timeout)[0].strip().splitlines()[-1])


def run_all(argv: list[str], count: int, devices_each: int, timeout: int = 240) -> list[str]:
    """Each process's stdout, by process id (see :func:`run_processes`)."""
    port = free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, *argv],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=cpu_env(
                devices_each,
                {
                    "MINIFIELD_COORDINATOR": f"127.0.0.1:{port}",
                    "MINIFIELD_NUM_PROCESSES": str(count),
                    "MINIFIELD_PROCESS_ID": str(rank),
                },
            ),
        )
        for rank in range(count)
    ]
    outputs = []
    try:
        for proc in procs:
            outputs.append(proc.communicate(timeout=timeout))
    finally:
        for proc in procs:
            proc.kill()
    for proc, (_out, err) in zip(procs, outputs, strict=True):
        assert proc.returncode == 0, err[-3000:]
    return [out for out, _err in outputs]
