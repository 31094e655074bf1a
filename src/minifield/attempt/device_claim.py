"""Getting the accelerator: it belongs to one process at a time.

A TPU chip is held by the process whose libtpu took its lock (``/tmp/libtpu_lockfile``), and
for a moment after that process exited: the driver lets go later than the process ends. A
worker started in that moment (a resumed attempt right after a crashed one) gets an error
from JAX's backend initialisation instead of a device. :func:`claim` retries that error — and
only that error — until the chip is free or the attempt's time to wait for it is spent; each
wait is reported (the attempt records it as ``device_wait`` events). An attempt that never
gets the chip ends ``device_busy`` with the holder named where it can be found
(:func:`lock_holders`), never as a crash.

JAX keeps what its first initialisation found: after a failed one the CPU backend it had
already started stays, and the next look at the devices would silently run on the CPU. The
backends are therefore cleared before each retry (``reset``).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from . import environment
from .result import AttemptError, Ending

if TYPE_CHECKING:
    from ..recipe import Recipe
    from .events import EventLog
    from .stopping import Stopping

#: libtpu's lock of the chip on this host
LIBTPU_LOCKFILE = "/tmp/libtpu_lockfile"

#: what the backend's error says when another process (or one that just ended) holds the
#: chip; any other error is not retried
BUSY_MARKERS = (
    "libtpu multi-process lockfile",
    "TPU backend already in use",
    "TPU is already in use",
)

#: seconds between two tries at first; doubled after each, up to :data:`MAX_PAUSE_S`
FIRST_PAUSE_S = 0.5
MAX_PAUSE_S = 8.0


def default_wait_s() -> float:
    """Seconds a worker waits for the chip when the recipe does not say
    (``runtime.device_wait_seconds``: the schema's ``x-absent``)."""
    from .. import schemas

    return schemas.absent("recipe.schema.json", "runtime")["device_wait_seconds"]


class DeviceBusy(Exception):
    """The accelerator stayed held by another process for all the time there was to wait."""


def is_busy_error(exc: BaseException) -> bool:
    """Whether ``exc`` is the backend's "the chip is held by another process" error."""
    text = str(exc)
    return any(marker.lower() in text.lower() for marker in BUSY_MARKERS)


def lock_holders(lockfile: str = LIBTPU_LOCKFILE, proc: Path = Path("/proc")) -> list[str]:
    """``"pid N (command line)"`` for every other process that has ``lockfile`` open, read
    from ``/proc/*/fd`` (processes of other users cannot be read, and are not named)."""
    try:
        target = os.path.realpath(lockfile)
    except OSError:
        return []
    holders = []
    for entry in sorted(proc.glob("[0-9]*"), key=lambda p: int(p.name)):
        if int(entry.name) == os.getpid():
            continue
        try:
            fds = list((entry / "fd").iterdir())
        except OSError:
            continue
        for fd in fds:
            try:
                if os.readlink(fd) == target:
                    holders.append(f"pid {entry.name} ({_command_line(entry)})")
                    break
            except OSError:
                continue
    return holders


def _command_line(entry: Path) -> str:
    try:
        raw = (entry / "cmdline").read_bytes()
    except OSError:
        return "command line not readable"
    return raw.replace(b"\0", b" ").decode("utf-8", errors="replace").strip()[:200] or "?"


@dataclass(frozen=True)
class Wait:
    """One refused try: what the backend said, who holds the chip, the pause before the next."""

    tries: int
    error: str
    holders: list[str]
    pause_s: float


@dataclass(frozen=True)
class Claimed:
    tries: int
    waited_s: float


def claim(
    open_backend: Callable[[], object],
    reset: Callable[[], None],
    *,
    wait_s: float,
    on_wait: Callable[[Wait], None],
    should_stop: Callable[[], str | None] = lambda: None,
    holders: Callable[[], list[str]] | None = None,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> Claimed:
    """Open the backend (``open_backend``), retrying while it says the chip is busy.

    Waits at most ``wait_s`` seconds in all; ``should_stop`` (a signal) ends the wait early.
    ``holders`` names who holds the chip (default :func:`lock_holders`).
    Raises :class:`DeviceBusy` naming the holder when the chip was not got; any other error
    of ``open_backend`` is raised as it is, at once.
    """
    started = clock()
    pause = FIRST_PAUSE_S
    tries = 0
    while True:
        tries += 1
        try:
            open_backend()
            return Claimed(tries, clock() - started)
        except Exception as exc:
            if not is_busy_error(exc):
                raise
            error = str(exc)
        reset()
        held_by = (holders or lock_holders)()
        waited = clock() - started
        stop = should_stop()
        if stop or waited + pause > wait_s:
            who = "; ".join(held_by) if held_by else "a process this one cannot see, or none"
            why = f"stopped waiting: {stop}" if stop else f"waited {waited:.1f} s of {wait_s:g} s"
            raise DeviceBusy(
                f"the accelerator is held by another process ({who}); {why}, {tries} tries "
                f"(runtime.device_wait_seconds); the backend said: {error}"
            )
        on_wait(Wait(tries, error, held_by, pause))
        sleep(pause)
        pause = min(pause * 2, MAX_PAUSE_S)


#: JAX's platform for a recipe's ``runtime.backend`` that must not fall back to the CPU
_PLATFORMS = {"tpu": "tpu"}


def jax_backend(backend: str) -> tuple[Callable[[], object], Callable[[], None]]:
    """``(open_backend, reset)`` for JAX: look at the devices (what starts the backends), and
    forget what a failed start left behind.

    For a recipe that names the TPU (``runtime.backend: tpu``) JAX is told to start that
    platform alone, unless ``JAX_PLATFORMS`` says otherwise: left to choose, JAX logs a TPU
    that fails to start (a busy one included) and goes on with the CPU."""
    import jax
    from jax._src import xla_bridge  # the one way to make JAX start its backends again

    platform = _PLATFORMS.get(backend)
    if platform and not jax.config.jax_platforms and not xla_bridge.backends_are_initialized():
        jax.config.update("jax_platforms", platform)
    return jax.devices, xla_bridge._clear_backends


def claim_for_attempt(
    recipe: Recipe, stopping: Stopping, events: EventLog
) -> tuple[Ending | None, dict]:
    """Start the recipe's backend for an attempt, waiting (within the attempt's time left)
    while another process still holds the accelerator; then take the environment's
    fingerprint. Returns the ``device_busy`` or ``failed`` ending when the accelerator was not
    got (else None), and the fingerprint."""
    runtime = recipe.data.get("runtime", {})
    wait_s = min(runtime.get("device_wait_seconds", default_wait_s()), stopping.seconds_left())
    backend = runtime.get("backend", "any")
    open_backend, reset = jax_backend(backend)

    def waiting(wait: Wait) -> None:
        events.emit(
            "device_wait",
            tries=wait.tries,
            pause_s=wait.pause_s,
            holders=wait.holders,
            error=wait.error[:1000],
        )

    def signalled() -> str | None:
        number = stopping.preemption.signal
        return None if number is None else f"signal {number}"

    try:
        claimed = claim(open_backend, reset, wait_s=wait_s, on_wait=waiting, should_stop=signalled)
    except DeviceBusy as exc:
        return Ending.device_busy(str(exc)), environment.fingerprint(devices=False)
    except Exception as exc:  # noqa: BLE001 - no backend: said in result.json, not a crash
        message = f"{type(exc).__name__}: {exc}"
        if backend != "any":
            message = (
                f"recipe runtime.backend={backend!r} but that backend does not start here "
                f"({message}); run on a {backend} host or set runtime.backend"
            )
        failed = Ending.failed(AttemptError("device", message))
        return failed, environment.fingerprint(devices=False)
    if claimed.tries > 1:
        events.emit("device_claimed", tries=claimed.tries, waited_s=claimed.waited_s)
    return None, environment.fingerprint()
