"""The evaluate stage over several processes (``evaluate.processes`` in the workflow config).

The stage starts them as a multi-process training attempt is started:

    python -m minifield.supervision.launch --processes N -- \\
        python -m minifield.pipeline.evaluation_processes --distributed --recipe R ...

(srun inside a SLURM allocation of N tasks, local processes joined on 127.0.0.1 elsewhere).
Each process loads the examples, lays out the recipe's mesh over the devices of all of them
(``training.data_parallel.devices`` must equal that count, as for training), restores every
checkpoint into the recipe's sharding and scores it on the mesh
(:mod:`.checkpoint_scores`). Process 0 alone writes: the selected export, and the figures
as a JSON file the stage reads back once every process has ended. What needs no mesh (the
acceptance checks, a recipe's lm-eval harness tasks, which read the export from disk) runs
afterwards in the stage's own process.

A recipe that names an accelerator (``runtime.backend`` gpu or tpu) is scored the same way
with one process, started on its own (no launcher): the stage's process keeps off the
accelerator (:mod:`minifield.supervision.accelerator`), and this one lets go of it on exit.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from .. import atomic
from .. import recipe as recipes
from ..attempt.options import enable_compilation_cache
from ..supervision import accelerator, distributed
from . import checkpoint_scores
from .errors import StageError

PROG = "minifield.pipeline.evaluation_processes"
#: exit statuses of one evaluation process: done, failed, refused before any figure
EXIT_DONE, EXIT_FAILED, EXIT_INVALID = 0, 1, 2
SCORES = "scores.json"


def command(
    processes: int,
    recipe_json: Path,
    train_result: Path,
    examples_dir: Path,
    scores: Path,
    selected_export: Path | None,
    quantized_base_dir: Path | None = None,
    compilation_cache: Path | None = None,
) -> list[str]:
    """The command line of an evaluation over ``processes`` processes: the launcher's, or
    one process's own (no launcher, no coordinator: a TPU host opens no socket)."""
    own = [sys.executable, "-m", PROG, "--recipe", str(recipe_json)]
    own += ["--train-result", str(train_result), "--examples", str(examples_dir)]
    own += ["--scores", str(scores)]
    if selected_export is not None:
        own += ["--selected-export", str(selected_export)]
    if quantized_base_dir is not None:
        own += ["--quantized-base", str(quantized_base_dir)]
    if compilation_cache is not None:
        own += ["--compilation-cache", str(compilation_cache)]
    if processes == 1:
        return own
    own.insert(3, "--distributed")
    launcher = [sys.executable, "-m", "minifield.supervision.launch"]
    return [*launcher, "--processes", str(processes), "--", *own]


def opens_accelerator(recipe: recipes.Recipe) -> bool:
    """Whether the recipe names an accelerator: its checkpoints are then scored in a process
    of their own, since the stage's process keeps off the accelerator (only a worker or a
    child that exits before the next opens it: minifield.supervision.accelerator)."""
    return recipe.data.get("runtime", {}).get("backend") in ("gpu", "tpu")


def _check_mesh(recipe: recipes.Recipe, processes: int) -> None:
    """Refuse, before any process starts, a recipe whose computation is on one device."""
    devices = recipe.strategy.devices_required(recipe.data)
    if devices == 1:
        raise StageError(
            f"evaluate.processes is {processes} in the workflow config, but computation "
            f"{recipe.job_id} ({recipe.strategy.name}) runs on one device "
            "(training.data_parallel.devices 1): its checkpoints are evaluated by one process; "
            "set evaluate.processes: 1"
        )


def run(
    recipe: recipes.Recipe,
    recipe_json: Path,
    train_result: Path,
    examples_dir: Path,
    out_selected_export: Path | None,
    processes: int,
    *,
    scratch: Path,
    log: Path | None = None,
    quantized_base_dir: Path | None = None,
    compilation_cache: Path | None = None,
) -> dict:
    """The figures of :func:`checkpoint_scores.score`, computed by ``processes`` processes.

    ``scratch`` is a directory every process sees (the stage's output directory): process
    0 leaves the figures there, whichever host it runs on. The processes' output goes to
    ``log`` (appended), or to this process's stderr.
    """
    if processes > 1:
        _check_mesh(recipe, processes)
    scratch.mkdir(parents=True, exist_ok=True)
    env = accelerator.worker_env()  # these processes may open it: the stage's own does not
    if recipe.data.get("runtime", {}).get("backend") == "cpu":
        env["JAX_PLATFORMS"] = "cpu"  # a CPU recipe on a GPU host must not take the GPUs
    with tempfile.TemporaryDirectory(dir=scratch, prefix=".evaluation-") as held:
        scores = Path(held) / SCORES
        cmd = command(
            processes, recipe_json, train_result, examples_dir, scores, out_selected_export,
            quantized_base_dir, compilation_cache,
        )  # fmt: skip
        with open(log or os.devnull, "a", encoding="utf-8") as out:
            stream = out if log is not None else None
            print(f"$ {' '.join(cmd)}", file=out if log is not None else sys.stderr, flush=True)
            code = subprocess.run(cmd, env=env, stdout=stream, stderr=stream, check=False)
        if code.returncode != EXIT_DONE or not scores.is_file():
            what = "refused the evaluation" if code.returncode == EXIT_INVALID else "failed"
            raise StageError(
                f"the {processes} evaluation processes of {recipe_json} {what} (exit "
                f"{code.returncode}); see {log or 'their messages above'}"
            )
        return atomic.read_json(scores)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=f"python -m {PROG}",
        description="One process of the evaluate stage over several processes (started by "
        "minifield.supervision.launch); process 0 writes the figures and the selected export.",
    )
    parser.add_argument("--recipe", type=Path, required=True, help="validated recipe.json")
    parser.add_argument("--train-result", type=Path, required=True, help="train/result.json")
    parser.add_argument("--examples", type=Path, required=True, help="prepared examples dir")
    parser.add_argument("--scores", type=Path, required=True, help="figures (process 0 writes)")
    parser.add_argument("--selected-export", type=Path, help="export of the selected checkpoint")
    parser.add_argument("--quantized-base", type=Path, help="the recipe's quantized base (dir)")
    parser.add_argument(
        "--compilation-cache",
        type=Path,
        help="the computation's compilation cache (its workers'): their programs loaded",
    )
    parser.add_argument(
        "--distributed",
        action="store_true",
        help="one process of several: the coordinator, count and id come from "
        "MINIFIELD_COORDINATOR / MINIFIELD_NUM_PROCESSES / MINIFIELD_PROCESS_ID or the SLURM step",
    )
    parser.add_argument("--join-timeout", type=int, default=300, metavar="S")
    return parser


def _devices_problem(recipe: recipes.Recipe, group: distributed.Group) -> str | None:
    """Why the processes' devices cannot hold the recipe's mesh (None: they can)."""
    import jax

    wanted, found = recipe.strategy.devices_required(recipe.data), jax.device_count()
    if group.size == 1 or wanted == found:
        return None
    return (
        f"{group.size} processes hold {found} devices in all, but the recipe's "
        f"training.data_parallel.devices is {wanted}: an evaluation over several processes "
        f"runs on the recipe's mesh over the devices of all of them. Set evaluate.processes "
        f"to a count of processes that holds {wanted} devices, or to 1"
    )


def _join(args) -> distributed.Group:
    if not args.distributed:
        return distributed.Group()
    topology = distributed.from_environment()
    return distributed.join(topology, args.join_timeout, f"{PROG}[{topology.process_id}]:")


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        recipe = recipes.load(args.recipe)
    except recipes.RecipeError as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return EXIT_INVALID
    try:
        group = _join(args)
    except distributed.DistributedError as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return EXIT_INVALID
    try:
        return _evaluate(args, recipe, group)
    except Exception as exc:
        if os.environ.get("MINIFIELD_TRACEBACK"):
            raise
        # one line, not a traceback; the peers end when the launcher's grace has passed
        print(f"{PROG}[{group.rank}]: {type(exc).__name__}: {exc}", file=sys.stderr)
        return EXIT_FAILED
    finally:
        if group.size > 1:
            import jax

            jax.distributed.shutdown()


def _evaluate(args, recipe: recipes.Recipe, group: distributed.Group) -> int:
    who = f"{PROG}[{group.rank}]"
    if args.compilation_cache is not None:
        enable_compilation_cache(args.compilation_cache)
    problem = _devices_problem(recipe, group)
    if problem:  # the same on every process: all end here, before any collective
        print(f"{who}: {problem}", file=sys.stderr)
        return EXIT_INVALID
    try:
        scores = checkpoint_scores.score(
            recipe, args.train_result, args.examples, args.selected_export, group,
            quantized_base_dir=args.quantized_base,
        )  # fmt: skip
    except StageError as exc:
        print(f"{who}: {exc}", file=sys.stderr)
        return EXIT_FAILED
    if group.is_writer:
        atomic.write_json(args.scores, scores)
    print(f"{who}: scored {len(scores['checkpoints'])} checkpoint(s){_peak()}", file=sys.stderr)
    return EXIT_DONE


def _peak() -> str:
    """The device's peak bytes in use (where the backend counts them), for the log: the
    evaluation's programs are compiled here, not by the worker that reports its update's."""
    import jax

    stats = jax.local_devices()[0].memory_stats() or {}
    peak = stats.get("peak_bytes_in_use")
    return "" if peak is None else f"; the device's peak {peak} bytes"


if __name__ == "__main__":
    sys.exit(main())
