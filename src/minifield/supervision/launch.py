"""Start the N processes of one multi-process worker attempt, as one command.

``python -m minifield.supervision.launch --processes N -- minifield-worker --distributed ...``

- Inside a SLURM job of at least N tasks (``SLURM_JOB_ID`` set; the task count from
  ``SLURM_NTASKS`` or ``scontrol show job``): ``srun --ntasks=N --kill-on-bad-exit=0
  --wait=GRACE CMD``;
  the tasks, possibly on several hosts, find each other from SLURM's environment
  (:mod:`minifield.supervision.distributed`). The Snakemake SLURM executor submits the ``qualify`` and
  ``train`` jobs with ``--ntasks=N`` when ``train.processes`` is N.
- Elsewhere: N local processes joined through ``MINIFIELD_COORDINATOR=127.0.0.1:<free
  port>``, ``MINIFIELD_NUM_PROCESSES`` and ``MINIFIELD_PROCESS_ID``. That is one machine
  standing in for N hosts: the multi-process code paths, not a speed-up.

The launcher is one process to supervise: SIGTERM and SIGINT are passed on to every
process, and it exits with process 0's exit code (the process that writes the attempt's
``result.json``), or, when process 0 succeeded but another did not, with that process's
code. srun itself answers SIGTERM by killing its tasks at once ("forcing job
termination"), which would skip the workers' preemption checkpoint; so srun runs in a
session of its own (a supervisor's signal to the launcher's process group does not reach
it), the signal goes to the step's tasks through ``scancel --signal`` (the step is found
by the unique name the launcher gives it), and srun is told to end if the launcher is
killed outright. When one local process ends in failure the
others get ``grace_s`` seconds to end on their own (JAX's distributed runtime stops them
when a peer is gone) and are then killed, so a launch never hangs on a dead peer; under
srun the same grace is srun's ``--wait``. (Not ``--kill-on-bad-exit``: a preempted task
exits 3, which srun counts as bad, and it killed the peer that was exiting 3 too, so the
step ended 143 instead of 3. The workers leave through ``jax.distributed.shutdown``, a
barrier, so a normal end never waits out the grace.)
"""

from __future__ import annotations

import argparse
import math
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence

from . import distributed


class LaunchError(ValueError):
    """The launch cannot start as asked."""


def allocation_tasks(env: Mapping[str, str] | None = None) -> int | None:
    """Tasks of the SLURM job this runs in; None outside one (or when it cannot be told).

    ``SLURM_NTASKS`` where it is set; where a job runner removed it (Snakemake's
    slurm-jobstep executor keeps only the job's identity, ``SLURM_JOB_ID``, so that nested
    ``srun`` calls do not inherit step settings) from ``scontrol show job``.
    """
    env = os.environ if env is None else env
    job_id = env.get("SLURM_JOB_ID")
    if not job_id:
        return None
    if env.get("SLURM_NTASKS"):
        try:
            return int(env["SLURM_NTASKS"])
        except ValueError:
            return None
    found = re.search(r"\bNumTasks=(\d+)", _slurm_query("scontrol", "show", "job", "-o", job_id))
    return int(found.group(1)) if found else None


def _slurm_query(*command: str) -> str:
    """Standard output of a SLURM client command; empty when it cannot be run."""
    try:
        return subprocess.run(
            command, capture_output=True, text=True, timeout=30, check=False
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        return ""


def srun_command(
    command: Sequence[str], processes: int, step_name: str = "", grace_s: float = 60.0
) -> list[str]:
    name = [f"--job-name={step_name}"] if step_name else []
    # --wait: once one task has ended, the others get grace_s seconds (0 would mean forever)
    wait = f"--wait={max(1, math.ceil(grace_s))}"
    return ["srun", f"--ntasks={processes}", "--kill-on-bad-exit=0", wait, *name, *command]


def step_id(job_id: str, step_name: str) -> str | None:
    """``JOB.STEP`` of the running step called ``step_name`` in job ``job_id``, if any."""
    listed = _slurm_query("squeue", "--steps", f"--jobs={job_id}", "--noheader", "--format=%i %j")
    for line in listed.splitlines():
        parts = line.split(None, 1)
        if len(parts) == 2 and parts[1].strip() == step_name:
            return parts[0]
    return None


def _end_with_parent() -> None:
    """In the srun child: SIGTERM when the launcher dies (Linux prctl PR_SET_PDEATHSIG), so a
    launcher killed outright does not leave its step running."""
    import ctypes

    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM), 0, 0, 0)
    except (OSError, AttributeError):
        pass


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _exit_code(returncode: int) -> int:
    """A signalled child (negative return code) as the shell reports it: 128 + signal."""
    return 128 - returncode if returncode < 0 else returncode


def _forward_signals(children: list[subprocess.Popen], slurm_step: tuple | None) -> dict:
    def forward(signum, _frame):
        if slurm_step is not None:
            step = step_id(*slurm_step)
            if step is not None:
                name = signal.Signals(signum).name.removeprefix("SIG")
                subprocess.run(["scancel", f"--signal={name}", step], check=False, timeout=30)
                return
        for child in children:
            if child.poll() is None:
                child.send_signal(signum)

    return {sig: signal.signal(sig, forward) for sig in (signal.SIGTERM, signal.SIGINT)}


def _start_srun(
    command: Sequence[str], processes: int, step_name: str, env: dict, grace_s: float
) -> subprocess.Popen:
    return subprocess.Popen(
        srun_command(command, processes, step_name, grace_s),
        env=env,
        start_new_session=True,
        preexec_fn=_end_with_parent,  # only a prctl call: safe before exec
    )


def _start_local(command: Sequence[str], processes: int, env: dict) -> list[subprocess.Popen]:
    base = {
        k: v
        for k, v in env.items()
        # the local processes are not SLURM tasks, even when launched inside a SLURM job
        if k not in (distributed.ENV_COORDINATOR, distributed.ENV_NUM_PROCESSES,
                     distributed.ENV_PROCESS_ID, "SLURM_STEP_NUM_TASKS")
    }  # fmt: skip
    if processes == 1:
        return [subprocess.Popen(list(command), env=base)]
    coordinator = f"127.0.0.1:{_free_port()}"
    return [
        subprocess.Popen(
            list(command),
            env={
                **base,
                distributed.ENV_COORDINATOR: coordinator,
                distributed.ENV_NUM_PROCESSES: str(processes),
                distributed.ENV_PROCESS_ID: str(rank),
            },
        )
        for rank in range(processes)
    ]


def _combined(codes: list[int]) -> int:
    if codes[0] != 0:
        return codes[0]
    return next((code for code in codes if code != 0), 0)


def launch(
    command: Sequence[str],
    processes: int,
    *,
    mode: str = "auto",
    grace_s: float = 60.0,
    env: Mapping[str, str] | None = None,
) -> int:
    """Run ``command`` as ``processes`` processes of one attempt; returns the exit code."""
    if processes < 1:
        raise LaunchError(f"--processes must be >= 1 (got {processes})")
    base = dict(os.environ if env is None else env)
    if mode not in ("auto", "slurm", "local"):
        raise LaunchError(f"--mode must be auto, slurm or local (got {mode!r})")
    job = base.get("SLURM_JOB_ID")
    asked = mode == "slurm" or (mode == "auto" and processes > 1)
    tasks = allocation_tasks(base) if asked else None  # scontrol at most once
    fits = tasks is not None and tasks >= processes
    if mode == "auto":
        mode = "slurm" if fits else "local"
    if mode == "slurm" and not fits:
        raise LaunchError(
            f"--mode slurm needs a SLURM allocation of at least {processes} tasks "
            "(run inside sbatch/salloc with --ntasks, or use --mode local)"
        )
    if processes > 1:
        if mode == "slurm":
            where = f"srun in SLURM job {job} ({tasks} tasks)"
        elif job:
            where = f"local processes on 127.0.0.1 (SLURM job {job} has too few tasks)"
        else:
            where = "local processes on 127.0.0.1"
        print(
            f"minifield.supervision.launch: {processes} processes: {where}",
            file=sys.stderr,
            flush=True,
        )
    if mode == "slurm":
        step_name = f"minifield-launch-{os.getpid()}"
        slurm_step = (job, step_name)
        children = [_start_srun(command, processes, step_name, base, grace_s)]
    else:
        slurm_step = None
        children = _start_local(command, processes, base)

    previous = _forward_signals(children, slurm_step)
    try:
        failed_at = None
        while True:
            codes = [child.poll() for child in children]  # every child, every round
            if None not in codes:
                break
            if failed_at is None and any(code not in (None, 0) for code in codes):
                failed_at = time.monotonic()
            if failed_at is not None and time.monotonic() - failed_at > grace_s:
                for child in children:
                    if child.poll() is None:
                        print(
                            f"minifield.supervision.launch: a peer failed {grace_s:.0f} s ago; killing "
                            f"pid {child.pid}",
                            file=sys.stderr,
                        )
                        child.kill()
            time.sleep(0.05)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return _combined([_exit_code(child.wait()) for child in children])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m minifield.supervision.launch",
        description="Start the processes of one multi-process worker attempt "
        "(srun inside a SLURM allocation, local processes elsewhere).",
    )
    parser.add_argument("--processes", type=int, required=True, metavar="N")
    parser.add_argument("--mode", choices=("auto", "slurm", "local"), default="auto")
    parser.add_argument(
        "--grace-seconds",
        type=float,
        default=60.0,
        help="after one local process failed, wait this long for the others, then kill them",
    )
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND [ARGS...]")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command given (put it after --)")
    try:
        return launch(command, args.processes, mode=args.mode, grace_s=args.grace_seconds)
    except LaunchError as exc:
        print(f"minifield.supervision.launch: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
