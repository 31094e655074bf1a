"""``minifield-worker``: list strategies, validate a recipe, or run one training attempt.

Exit codes: 0 completed, 1 failed, 2 invalid job or inputs, 3 preempted
(checkpoint committed), 4 limit reached (deadline or compute budget).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from . import distributed, strategies, train
from . import recipe as recipes


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
        "--allow-environment-change",
        action="store_true",
        help="resume even though the environment fingerprint differs (recorded)",
    )
    parser.add_argument(
        "--record-state-hashes",
        action="store_true",
        help="add the complete-state hash to every update event",
    )
    parser.add_argument(
        "--compilation-cache",
        type=Path,
        metavar="DIR",
        help="JAX persistent compilation cache directory (a resumed attempt skips recompiling)",
    )
    parser.add_argument(
        "--stop-after-step",
        type=int,
        metavar="N",
        help="operational step limit: end after N updates with a committed checkpoint and "
        "limit_reached (exit 4); the computation (and its digest) is unchanged, so a later "
        "attempt can resume it (used by the recovery-proof qualification)",
    )
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
    multi.add_argument("--num-processes", type=int, metavar="N", help="processes in all")
    multi.add_argument("--process-id", type=int, metavar="I", help="this process, 0..N-1")
    multi.add_argument(
        "--join-timeout",
        type=int,
        default=300,
        metavar="S",
        help="end when the other processes have not all joined within S seconds (JAX's "
        "runtime aborts the process, exit 134; default 300)",
    )
    faults = parser.add_argument_group("fault injection (tests and qualification only)")
    faults.add_argument(
        "--fail-after-step", type=int, metavar="K", help="hard exit right after update K"
    )
    faults.add_argument(
        "--stall-after-step", type=int, metavar="K", help="stop emitting events after update K"
    )
    faults.add_argument(
        "--kill-during-checkpoint",
        type=int,
        metavar="K",
        help="SIGKILL the worker itself while checkpoint K is being written (before it commits)",
    )
    faults.add_argument(
        "--stall-seconds", type=float, default=10.0, metavar="S", help="length of the stall"
    )
    return parser


def _validate_only(job: Path) -> int:
    try:
        recipe = recipes.load(job)
    except recipes.RecipeError as exc:
        document = None
        try:
            document = recipes.read_document(job)
        except recipes.RecipeError:
            pass
        spec = document.get("strategy") if isinstance(document, dict) else None
        print(
            json.dumps(
                {
                    "valid": False,
                    "computation_digest": None,
                    "strategy": spec if isinstance(spec, dict) else None,
                    "errors": exc.errors,
                },
                indent=2,
            )
        )
        return train.EXIT_INVALID
    print(
        json.dumps(
            {
                "valid": True,
                "computation_digest": recipe.computation_digest,
                "examples_digest": recipe.examples_digest,
                "strategy": {"name": recipe.strategy.name, "version": recipe.strategy.version},
            },
            indent=2,
        )
    )
    return 0


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
    if topology.is_multi_process:
        # said before joining: a peer that never comes makes JAX's runtime abort the process
        print(
            f"minifield-worker: process {topology.process_id} of {topology.num_processes} "
            f"joining coordinator {topology.coordinator} ({topology.source}; waiting at most "
            f"{args.join_timeout} s for the others)",
            file=sys.stderr,
            flush=True,
        )
    return distributed.Group(distributed.initialize(topology, timeout_seconds=args.join_timeout))


def main(argv: list[str] | None = None) -> int:
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
    try:
        recipe = recipes.load(args.job)
    except recipes.RecipeError as exc:
        print(f"minifield-worker: {exc}", file=sys.stderr)
        return train.EXIT_INVALID
    if not args.input_root.is_dir():
        print(
            f"minifield-worker: --input-root {args.input_root} is not a directory", file=sys.stderr
        )
        return train.EXIT_INVALID
    for name in (
        "stop_after_step",
        "fail_after_step",
        "stall_after_step",
        "kill_during_checkpoint",
    ):
        value = getattr(args, name)
        if value is not None and value < 1:
            print(
                f"minifield-worker: --{name.replace('_', '-')} must be >= 1 (got {value})",
                file=sys.stderr,
            )
            return train.EXIT_INVALID
    if args.resume_from is not None and not args.resume_from.is_dir():
        print(
            f"minifield-worker: --resume-from {args.resume_from} is not a directory",
            file=sys.stderr,
        )
        return train.EXIT_INVALID
    try:
        group = _start_processes(args)
    except distributed.DistributedError as exc:
        print(f"minifield-worker: {exc}", file=sys.stderr)
        return train.EXIT_INVALID
    options = train.Options(
        input_root=args.input_root,
        output_root=args.output_root,
        resume_from=args.resume_from,
        attempt_id=args.attempt_id,
        examples_dir=args.examples,
        allow_environment_change=args.allow_environment_change,
        record_state_hashes=args.record_state_hashes,
        compilation_cache=args.compilation_cache,
        stop_after_step=args.stop_after_step,
        faults=train.Faults(
            args.fail_after_step,
            args.stall_after_step,
            args.stall_seconds,
            args.kill_during_checkpoint,
        ),
        group=group,
    )
    try:
        code, attempt_dir = train.run(recipe, options)
    except train.ResumeRefused as exc:
        print(f"minifield-worker: {exc}", file=sys.stderr)
        return train.EXIT_INVALID
    finally:
        if group.size > 1:
            import jax

            jax.distributed.shutdown()
    if not group.is_writer:
        print(
            f"minifield-worker[{group.rank}]: exit {code}; process 0 records the attempt in "
            f"{attempt_dir}",
            file=sys.stderr,
        )
        return code
    result = json.loads((attempt_dir / train.RESULT_FILE).read_text())
    if result.get("error"):
        print(
            f"minifield-worker: {result['status']} in phase {result['error']['phase']}: {result['error']['message']}",
            file=sys.stderr,
        )
    print(f"minifield-worker: {result['status']} -> {attempt_dir}", file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())
