"""Multi-process (multi-host) JAX start-up: who is the coordinator, how many processes, which one am I.

The topology comes from, in order of precedence:

1. explicit arguments (``coordinator``, ``num_processes``, ``process_id``);
2. the environment variables ``MINIFIELD_COORDINATOR`` (``host:port``),
   ``MINIFIELD_NUM_PROCESSES`` and ``MINIFIELD_PROCESS_ID``;
3. a SLURM job step with more than one task (``srun -n N``): ``SLURM_NTASKS``,
   ``SLURM_PROCID``, the first host of ``SLURM_STEP_NODELIST`` and a port derived
   from ``SLURM_JOB_ID`` (the same rule as JAX's own SLURM detection, so every task
   computes the same address without talking to the others);
4. otherwise a single process, for which nothing is initialised.

Explicit settings must be complete: a partial set is an error, never silently
mixed with SLURM's values. On CPU, cross-process collectives need the gloo
implementation, which :func:`initialize` selects before JAX starts its backends.

Once started, the processes of one training attempt act as a :class:`Group`:
every process runs the same program on its part of the device mesh, and the few
decisions that are not a pure function of the recipe (the attempt id, whether a
signal or a time limit ends the run, whether every process got through set-up)
are taken together, so no process is left waiting in a collective for a peer
that has already stopped.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from collections.abc import Mapping
from dataclasses import asdict, dataclass

import numpy as np

ENV_COORDINATOR = "MINIFIELD_COORDINATOR"
ENV_NUM_PROCESSES = "MINIFIELD_NUM_PROCESSES"
ENV_PROCESS_ID = "MINIFIELD_PROCESS_ID"


class DistributedError(ValueError):
    """The multi-process settings are incomplete or inconsistent."""


@dataclass(frozen=True)
class Topology:
    coordinator: str | None  # host:port of process 0's coordination service; None if single
    num_processes: int
    process_id: int
    source: str  # "explicit", "environment", "slurm" or "single"

    @property
    def is_multi_process(self) -> bool:
        return self.num_processes > 1

    @property
    def is_writer(self) -> bool:
        """Only process 0 writes shared files (events, results, the checkpoint commit)."""
        return self.process_id == 0


def first_host(nodelist: str) -> str:
    """First host name of a SLURM node list: ``node[003-005,9],gpu1`` -> ``node003``."""
    match = re.fullmatch(r"([^,\[]+)(?:\[([^\]]+)\])?(?:,.*)?", nodelist.strip())
    if not match:
        raise DistributedError(f"cannot parse SLURM node list {nodelist!r}")
    prefix, ranges = match.groups()
    if ranges is None:
        return prefix
    return prefix + re.split(r"[,-]", ranges, maxsplit=1)[0]


def slurm_port(job_id: str) -> int:
    """A port every task of the job derives alike, in the top 4096 of the port range."""
    return int(job_id) % 4096 + (65535 - 4096 + 1)


def _int(value, what: str) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        raise DistributedError(f"{what} must be an integer, got {value!r}") from None


def _checked(coordinator, num_processes, process_id, source: str) -> Topology:
    num = _int(num_processes, f"{source}: number of processes")
    pid = _int(process_id, f"{source}: process id")
    if num < 1:
        raise DistributedError(f"{source}: number of processes must be >= 1, got {num}")
    if not 0 <= pid < num:
        raise DistributedError(f"{source}: process id {pid} is not in [0, {num})")
    if num > 1 and not re.fullmatch(r"[^:\s]+:\d+", str(coordinator or "")):
        raise DistributedError(f"{source}: coordinator must be host:port, got {coordinator!r}")
    return Topology(str(coordinator) if num > 1 else None, num, pid, source)


def from_environment(
    env: Mapping[str, str] | None = None,
    *,
    coordinator: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
) -> Topology:
    """Work out the topology (see the module docstring for the precedence)."""
    env = os.environ if env is None else env
    explicit = {
        "coordinator": coordinator,
        "num_processes": num_processes,
        "process_id": process_id,
    }
    given = {k for k, v in explicit.items() if v is not None}
    if given:
        if len(given) == 1 and num_processes == 1:
            return Topology(None, 1, 0, "explicit")
        if given != set(explicit):
            raise DistributedError(
                f"explicit multi-process settings are incomplete: missing {sorted(set(explicit) - given)}"
            )
        return _checked(coordinator, num_processes, process_id, "explicit")

    names = (ENV_COORDINATOR, ENV_NUM_PROCESSES, ENV_PROCESS_ID)
    present = [n for n in names if env.get(n)]
    if present:
        if len(present) != len(names):
            missing = sorted(set(names) - set(present))
            raise DistributedError(f"environment sets {present} but not {missing}")
        return _checked(
            env[ENV_COORDINATOR], env[ENV_NUM_PROCESSES], env[ENV_PROCESS_ID], "environment"
        )

    ntasks = env.get("SLURM_STEP_NUM_TASKS") or env.get("SLURM_NTASKS")
    if ntasks and _int(ntasks, "SLURM_NTASKS") > 1 and "SLURM_PROCID" in env:
        for name in ("SLURM_JOB_ID", "SLURM_STEP_NODELIST"):
            if not env.get(name):
                raise DistributedError(f"SLURM step with {ntasks} tasks but {name} is not set")
        host = first_host(env["SLURM_STEP_NODELIST"])
        address = f"{host}:{slurm_port(env['SLURM_JOB_ID'])}"
        return _checked(address, ntasks, env["SLURM_PROCID"], "slurm")
    return Topology(None, 1, 0, "single")


def srun_tasks(env: Mapping[str, str] | None = None) -> int:
    """Tasks of the current ``srun`` step (1 outside one); only srun sets this variable."""
    env = os.environ if env is None else env
    try:
        return int(env.get("SLURM_STEP_NUM_TASKS") or 1)
    except ValueError:
        return 1


def initialize(topology: Topology | None = None, *, timeout_seconds: int = 120) -> Topology:
    """Start JAX's multi-process runtime for ``topology`` (a no-op for a single process).

    Must run before anything touches a JAX device.
    """
    topology = topology or from_environment()
    if not topology.is_multi_process:
        return topology
    import jax

    # CPU backends exchange collectives through gloo; without it a cross-process
    # psum on CPU is unsupported. GPU/TPU backends ignore this setting.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    try:
        jax.distributed.initialize(
            coordinator_address=topology.coordinator,
            num_processes=topology.num_processes,
            process_id=topology.process_id,
            initialization_timeout=timeout_seconds,
        )
    except Exception as exc:  # noqa: BLE001 - JAX raises runtime errors of several types
        raise DistributedError(
            f"{topology.source}: process {topology.process_id} of {topology.num_processes} could "
            f"not join the coordinator {topology.coordinator} within {timeout_seconds} s "
            f"({type(exc).__name__}: {str(exc)[:300]}); start every process with the same "
            "coordinator and process count, and process 0 reachable at that address"
        ) from exc
    return topology


#: bytes of a text exchanged between processes (messages are cut to fit)
TEXT_BYTES = 1024


def _encode(text: str) -> np.ndarray:
    data = text.encode("utf-8")[:TEXT_BYTES]
    buffer = np.zeros(TEXT_BYTES + 4, np.uint8)
    buffer[:4] = np.frombuffer(np.uint32(len(data)).tobytes(), np.uint8)
    buffer[4 : 4 + len(data)] = np.frombuffer(data, np.uint8)
    return buffer


def _decode(buffer: np.ndarray) -> str:
    buffer = np.asarray(buffer, np.uint8)
    size = int(np.frombuffer(buffer[:4].tobytes(), np.uint32)[0])
    return buffer[4 : 4 + size].tobytes().decode("utf-8", errors="replace")


class Group:
    """The processes of one attempt, for the decisions they must take together.

    Every method is a collective: all processes call it at the same point of the
    program (the training loop is the same in each, so they do). For a single
    process each is a plain local computation and JAX is not touched.
    """

    def __init__(self, topology: Topology | None = None):
        self.topology = topology or Topology(None, 1, 0, "single")

    @property
    def size(self) -> int:
        return self.topology.num_processes

    @property
    def rank(self) -> int:
        return self.topology.process_id

    @property
    def is_writer(self) -> bool:
        return self.topology.is_writer

    def _allgather(self, value: np.ndarray) -> np.ndarray:
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(value))

    def broadcast_text(self, text: str) -> str:
        """Process 0's ``text``, on every process."""
        if self.size == 1:
            return text
        from jax.experimental import multihost_utils

        return _decode(multihost_utils.broadcast_one_to_all(_encode(text)))

    def gather_texts(self, text: str) -> list[str]:
        """Every process's ``text``, by process id."""
        if self.size == 1:
            return [text]
        return [_decode(row) for row in self._allgather(_encode(text))]

    def gather_ints(self, value: int) -> list[int]:
        """Every process's ``value``, by process id."""
        if self.size == 1:
            return [int(value)]
        return [int(v) for v in self._allgather(np.asarray(value, np.int32)).reshape(-1)]

    def barrier(self, name: str) -> None:
        """Wait until every process reached the barrier called ``name``."""
        if self.size > 1:
            from jax.experimental import multihost_utils

            multihost_utils.sync_global_devices(name)


def join(topology: Topology, timeout_seconds: int, who: str) -> Group:
    """The group of ``topology``'s processes, this one joined; ``who`` (the program and this
    process) says so on stderr first."""
    if topology.is_multi_process:
        # said before joining: a peer that never comes makes JAX's runtime abort the process
        print(
            f"{who} joining coordinator {topology.coordinator} ({topology.source}; waiting at "
            f"most {timeout_seconds} s for the others)",
            file=sys.stderr,
            flush=True,
        )
    return Group(initialize(topology, timeout_seconds=timeout_seconds))


def probe() -> dict:
    """Initialise, then sum (process id + 1) over all processes with a psum on a global mesh."""
    topology = initialize()
    import jax
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = jax.make_mesh((jax.device_count(),), ("p",))
    local = np.full((jax.local_device_count(),), float(topology.process_id + 1), np.float32)
    x = jax.make_array_from_process_local_data(NamedSharding(mesh, P("p")), local)
    summed = jax.jit(
        jax.shard_map(lambda a: jax.lax.psum(a, "p"), mesh=mesh, in_specs=P("p"), out_specs=P())
    )(x)
    return {
        **asdict(topology),
        "process_index": jax.process_index(),
        "process_count": jax.process_count(),
        "device_count": jax.device_count(),
        "local_device_count": jax.local_device_count(),
        "psum": float(np.asarray(summed.addressable_data(0))[0]),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m minifield.supervision.distributed",
        description="Show the multi-process topology; with --probe, initialise JAX and run a psum.",
    )
    parser.add_argument("--probe", action="store_true", help="initialise and run a psum")
    args = parser.parse_args(argv)
    try:
        out = probe() if args.probe else asdict(from_environment())
    except DistributedError as error:
        print(f"minifield.supervision.distributed: {error}", file=sys.stderr)
        return 2
    print(json.dumps(out, sort_keys=True), flush=True)
    if args.probe and out["num_processes"] > 1:
        import jax

        jax.distributed.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
