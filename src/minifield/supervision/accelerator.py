"""Only a worker opens the accelerator.

libtpu lets one process hold a TPU chip, and a process that so much as lists JAX's devices
holds it until it exits; left to choose, JAX starts every backend it can. So a process that
starts or judges workers (the supervisor, the recovery prover with its checkpoint checks,
the Snakemake stages, the command line, a benchmark's parent) calls :func:`keep_off` before
it could start JAX: from then on its JAX, and that of every process it starts, runs on the
CPU. A process that needs the accelerator is started with :func:`worker_env`, which gives it
the platforms the parent was itself given.

The platforms a parent was given are kept in :data:`WORKER_PLATFORMS` (empty: JAX's own
choice), set once, by the first parent of a tree, so a parent's child that is itself a parent
(Snakemake's script processes, the prover under the device check) hands on the original.
Setting it beforehand gives the workers other platforms than their parents', as the contract's
test does: ``JAX_PLATFORMS=tpu`` on a host without one fails every parent that would start JAX
other than on the CPU, while ``MINIFIELD_WORKER_JAX_PLATFORMS=cpu`` lets the workers train.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, MutableMapping

#: the JAX platforms of the processes that may open the accelerator (empty: JAX's choice)
WORKER_PLATFORMS = "MINIFIELD_WORKER_JAX_PLATFORMS"
JAX_PLATFORMS = "JAX_PLATFORMS"


class AcceleratorHeld(RuntimeError):
    """This process already started a JAX backend other than the CPU's."""


def keep_off(environ: MutableMapping[str, str] | None = None) -> None:
    """This process, and every process it starts other than through :func:`worker_env`, runs
    JAX on the CPU. Idempotent; raises :class:`AcceleratorHeld` where JAX already started
    another backend here (too late to let go of it)."""
    environ = os.environ if environ is None else environ
    if WORKER_PLATFORMS not in environ:
        environ[WORKER_PLATFORMS] = environ.get(JAX_PLATFORMS, "")
    environ[JAX_PLATFORMS] = "cpu"
    if environ is os.environ and "jax" in sys.modules:
        _keep_jax_off()


def _keep_jax_off() -> None:
    import jax
    from jax._src import xla_bridge

    if not xla_bridge.backends_are_initialized():
        jax.config.update("jax_platforms", "cpu")
        return
    started = sorted(set(xla_bridge.backends()) - {"cpu"})
    if started:
        raise AcceleratorHeld(
            f"this process already started JAX's {', '.join(started)} backend, so it holds the "
            "accelerator: only a worker may open it (minifield.supervision.accelerator)"
        )


def worker_env(base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment of a process that may open the accelerator: ``base`` (this process's
    environment by default) with the platforms the first parent was given."""
    env = dict(os.environ if base is None else base)
    platforms = env.pop(WORKER_PLATFORMS, None)
    if platforms is None:  # no parent kept off: the environment is the worker's already
        return env
    if platforms:
        env[JAX_PLATFORMS] = platforms
    else:
        env.pop(JAX_PLATFORMS, None)
    return env
