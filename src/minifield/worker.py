"""``minifield-worker``: list strategies, validate a recipe, or run one training attempt.

Exit codes: 0 completed, 1 failed, 2 invalid job or inputs, 3 preempted
(checkpoint committed), 4 limit reached (deadline or compute budget), 5 I/O failure (the
output could not be written: a full disk, a quota, a file-size limit; resumable), 6 device
busy (another process held the accelerator for all the time there was to wait).

A thin layer over the Python API (:mod:`minifield.api`): this module parses
arguments, starts the processes of a multi-process attempt and prints; what is
validated and run, and with which outcome, is ``api.validate`` and ``api.run``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from . import api, strategies
from .attempt import environment
from .commands import bounded_float, bounded_int, report_unexpected
from .supervision import distributed

#: an update number the state's int32 step counter can reach
_STEP = bounded_int(1, 2**31 - 1)


def _hash_cadence(value: str) -> int | str:
    from .attempt.hash_cadence import HashCadence

    try:
        return HashCadence.parse(value).describe()
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="minifield-worker",
        description="Run one training attempt of a minifield recipe (or list/validate).",
    )
    parser.add_argument(
        "--list-strategies", action="store_true", help="print accepted computations as JSON"
    )
    parser.add_argument("--job", type=Path, help="recipe file (JSON or YAML)")
    parser.add_argument(
        "--validate-only",
        action="store_true",
        help="validate the recipe and print the verdict as JSON",
    )
    parser.add_argument(
        "--input-root", type=Path, help="directory the recipe's input paths are relative to"
    )
    parser.add_argument(
        "--output-root", type=Path, help="attempts are written to OUT/<job_id>/<attempt_id>/"
    )
    parser.add_argument(
        "--resume-from", type=Path, help="previous attempt directory to resume from (read only)"
    )
    parser.add_argument(
        "--attempt-id", help="identity of this execution (default: recipe's, or generated)"
    )
    parser.add_argument(
        "--examples", type=Path, help="prepared examples directory (default: prepare in memory)"
    )
    parser.add_argument(
        "--quantized-base",
        type=Path,
        help="the recipe's quantized base, made by the pipeline (default: quantize in memory)",
    )
    parser.add_argument(
        "--allow-environment-change",
        action="store_true",
        help="resume even though the environment fingerprint differs (recorded)",
    )
    parser.add_argument(
        "--record-state-hashes",
        action="store_true",
        help="add the complete-state hash to every update event (= --state-hash-every 1)",
    )
    parser.add_argument(
        "--state-hash-every",
        type=_hash_cadence,
        metavar="K|checkpoint",
        help="add the complete-state hash to every K-th update event; 'checkpoint': to none "
        "(the checkpoints' manifests always carry it). Default: 1 with "
        "--record-state-hashes, else checkpoint",
    )
    parser.add_argument(
        "--compilation-cache",
        type=Path,
        metavar="DIR",
        help="JAX persistent compilation cache directory (a resumed attempt skips recompiling)",
    )
    parser.add_argument(
        "--stop-after-step",
        type=_STEP,
        metavar="N",
        help="operational step limit: end after N updates with a committed checkpoint and "
        "limit_reached (exit 4); the computation (and its digest) is unchanged, so a later "
        "attempt can resume it (used by the recovery-proof qualification)",
    )
    _add_multi_process_arguments(parser)
    _add_fault_arguments(parser)
    return parser


def _add_multi_process_arguments(parser: argparse.ArgumentParser) -> None:
    multi = parser.add_argument_group(
        "multi-process training (one process per host; only process 0 writes)"
    )
    multi.add_argument(
        "--distributed",
        action="store_true",
        help="train as one process of several: the coordinator, process count and id come from "
        "MINIFIELD_COORDINATOR / MINIFIELD_NUM_PROCESSES / MINIFIELD_PROCESS_ID or from the "
        "SLURM step (srun -n N); every process needs the same recipe, inputs and output root",
    )
    multi.add_argument("--coordinator", metavar="HOST:PORT", help="process 0's address")
    multi.add_argument(
        "--num-processes", type=bounded_int(1, 65536), metavar="N", help="processes in all"
    )
    multi.add_argument(
        "--process-id", type=bounded_int(0, 65535), metavar="I", help="this process, 0..N-1"
    )
    multi.add_argument(
        "--join-timeout",
        type=bounded_int(1, 7 * 86400),
        default=300,
        metavar="S",
        help="end when the other processes have not all joined within S seconds (JAX's "
        "runtime aborts the process, exit 134; default 300)",
    )


def _add_fault_arguments(parser: argparse.ArgumentParser) -> None:
    faults = parser.add_argument_group("fault injection (tests and qualification only)")
    at_update = (
        ("--fail-after-step", "hard exit right after update K"),
        ("--stall-after-step", "stop emitting events after update K"),
        (
            "--kill-during-checkpoint",
            "SIGKILL the worker itself while checkpoint K is being written (before it commits)",
        ),
    )
    for flag, fault in at_update:
        faults.add_argument(flag, type=_STEP, metavar="K", help=fault)
    faults.add_argument(
        "--stall-seconds",
        type=bounded_float(0, 86400),
        default=10.0,
        metavar="S",
        help="length of the stall",
    )
    faults.add_argument(
        "--stall-ends-on-stop",
        action="store_true",
        help="the stall ends once SIGTERM/SIGINT has arrived (a hold until the supervisor's "
        "preemption lands, as the recovery proof's preempted run; without it the stall is a "
        "hung worker's)",
    )


def _validate_only(job: Path) -> int:
    verdict = api.validate(job)
    print(json.dumps(verdict.to_json(), indent=2))
    return api.EXIT_COMPLETED if verdict.valid else api.EXIT_INVALID


def _start_processes(args) -> distributed.Group:
    """The processes of this attempt: one, unless asked for several (then JAX's distributed
    runtime is started before anything touches a device)."""
    explicit = (args.coordinator, args.num_processes, args.process_id)
    if not args.distributed and all(v is None for v in explicit):
        tasks = distributed.srun_tasks()
        if tasks > 1:
            # N independent copies of one attempt would each train and write the same job
            raise distributed.DistributedError(
                f"this is a SLURM step of {tasks} tasks: pass --distributed to train as one "
                f"attempt over {tasks} processes, or run a single task (srun -n 1)"
            )
        return distributed.Group()
    topology = distributed.from_environment(
        coordinator=args.coordinator, num_processes=args.num_processes, process_id=args.process_id
    )
    who = f"minifield-worker: process {topology.process_id} of {topology.num_processes}"
    return distributed.join(topology, args.join_timeout, who)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # before JAX starts its backend: a GPU run computes deterministically (environment.py)
    environment.add_gpu_determinism_flags()
    try:
        return _main(argv)
    except KeyboardInterrupt:
        print("minifield-worker: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:
        if os.environ.get("MINIFIELD_TRACEBACK"):
            raise
        report_unexpected("minifield-worker", argv, exc)
        return api.EXIT_FAILED


def _main(argv: list[str]) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.list_strategies:
        print(json.dumps([s.describe() for s in strategies.available()], indent=2))
        return 0
    if args.job is None:
        parser.error("--job is required (or use --list-strategies)")
    if args.validate_only:
        return _validate_only(args.job)
    if args.input_root is None or args.output_root is None:
        parser.error("a run needs --input-root and --output-root")
    # Everything that can be refused is refused before joining other processes.
    checked = api.validate(args.job)
    if not checked.valid:
        print(f"minifield-worker: {checked.describe_errors()}", file=sys.stderr)
        return api.EXIT_INVALID
    from .attempt import train  # JAX: only for a run

    faults = train.Faults(
        args.fail_after_step,
        args.stall_after_step,
        args.stall_seconds,
        args.kill_during_checkpoint,
        args.stall_ends_on_stop,
    )
    problems = api.run_problems(
        args.input_root,
        resume_from=args.resume_from,
        stop_after_step=args.stop_after_step,
        faults=faults,
    )
    if problems:
        print(f"minifield-worker: {problems[0]}", file=sys.stderr)
        return api.EXIT_INVALID
    try:
        group = _start_processes(args)
    except distributed.DistributedError as exc:
        print(f"minifield-worker: {exc}", file=sys.stderr)
        return api.EXIT_INVALID
    try:
        outcome = api.run(
            checked,
            input_root=args.input_root,
            output_root=args.output_root,
            resume_from=args.resume_from,
            attempt_id=args.attempt_id,
            examples_dir=args.examples,
            quantized_base_dir=args.quantized_base,
            allow_environment_change=args.allow_environment_change,
            record_state_hashes=(
                args.state_hash_every
                if args.state_hash_every is not None
                else args.record_state_hashes
            ),
            compilation_cache=args.compilation_cache,
            stop_after_step=args.stop_after_step,
            faults=faults,
            group=group,
        )
    finally:
        if group.size > 1:
            import jax

            jax.distributed.shutdown()
    if outcome.attempt_dir is None and outcome.error:
        # ended before an attempt was opened: nothing on disk says why, so say it here
        status = "" if outcome.status == "invalid" else f"{outcome.status}: "
        print(f"minifield-worker: {status}{outcome.error['message']}", file=sys.stderr)
    elif not group.is_writer:
        print(
            f"minifield-worker[{group.rank}]: exit {outcome.exit_code}; process 0 records the "
            f"attempt in {outcome.attempt_dir}",
            file=sys.stderr,
        )
    else:
        if outcome.error:
            print(
                f"minifield-worker: {outcome.status} in phase {outcome.error['phase']}: "
                f"{outcome.error['message']}",
                file=sys.stderr,
            )
        print(f"minifield-worker: {outcome.status} -> {outcome.attempt_dir}", file=sys.stderr)
    return outcome.exit_code


if __name__ == "__main__":
    sys.exit(main())
