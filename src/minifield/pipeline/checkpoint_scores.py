"""The evaluate stage's figures: every retained checkpoint scored on DEV, one selected on DEV,
TEST assessed for it only, its weights exported.

What every process of the stage runs. In one process a checkpoint is restored onto one
device, as ever. In a group of processes (``evaluate.processes``) the program's mesh is laid
out over the devices of all of them first, so the state template is created in the recipe's
sharding: ``checkpoint.load`` reads in each process only the slices its devices hold and
puts them there (the state hash then checked over the placed pieces), :meth:`Program.place`
puts what it read whole on the mesh, and DEV and TEST are computed on the mesh (the
evaluator reads the replicated sums locally). Every decision is taken together (a checkpoint
one process cannot verify is rejected by all), so no process waits in a collective for a
peer that skipped it. The checkpoint format imports JAX: it is imported inside the functions.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from .. import atomic
from ..attempt.chain import committed_checkpoints
from ..hf import quantized_base
from ..inputs import examples
from ..recipe import Recipe
from ..supervision import distributed
from .errors import StageError


def retained_checkpoints(attempt_dir: Path) -> list[Path]:
    """Committed checkpoints along the attempt chain, one per step (the newest attempt's wins)."""
    by_step: dict[int, Path] = {}
    for step, path in committed_checkpoints(attempt_dir):
        by_step.setdefault(step, path)
    return [by_step[s] for s in sorted(by_step)]


class _Restorer:
    """Checkpoints restored where the program evaluates them: one device, or the mesh."""

    def __init__(self, program, recipe: Recipe, group: distributed.Group):
        self.program, self.recipe, self.group = program, recipe, group
        if group.size > 1:
            # the template in the recipe's sharding: each process reads only its own slices
            program.lay_out_mesh()

    def load(self, path: Path) -> tuple[Any, dict]:
        """The checkpoint's state and manifest; CheckpointError when any process cannot
        verify it (the same outcome on every process)."""
        from ..state import checkpoint

        failure, state, manifest = "", None, None
        try:
            # shapes and shardings only: no second state beside the one scored
            state, manifest = checkpoint.load(
                path,
                self.program.state_template(),
                computation_digest=self.recipe.computation_digest,
            )
        except checkpoint.CheckpointError as exc:
            failure = str(exc)
        failures = self.group.gather_texts(failure)
        refused = next(((rank, text) for rank, text in enumerate(failures) if text), None)
        if refused is not None:
            rank, text = refused
            by = f" (process {rank} of {self.group.size})" if self.group.size > 1 else ""
            raise checkpoint.CheckpointError(f"{text}{by}")
        if self.group.size > 1:
            state = self.program.place(state)
        if manifest.get("sliced"):
            # each process read only its own slices: the state hash over the placed pieces
            # (a collective; every process reaches it, so every process refuses alike)
            checkpoint.verify_placed(state, str(path), manifest["state_hash"])
        return state, manifest


def _selected_export(program, state, directory: Path, group: distributed.Group) -> None:
    """The selected checkpoint's weights exported into ``directory`` (replacing any).

    Over several processes a program that ``exports_where_held`` (every language-model one)
    writes it with them all, each process the slices its devices hold (nothing gathered, as
    the end of a multi-process training attempt does; process 0 commits it by rename);
    another's parameters are first copied whole to every host (a collective) and process 0
    writes it. The optimizer state is never gathered.
    """
    if group.size > 1 and program.exports_where_held:
        from ..state import export

        if group.is_writer and directory.exists():
            shutil.rmtree(directory)  # before write_whole's first agreement: none writes yet
        export.write_whole(
            directory, lambda partial: program.export(state, partial, group=group), group
        )
        return
    if group.size > 1:
        import jax

        from ..state.arrays import to_host

        state = {**state, "params": jax.tree_util.tree_map(to_host, state["params"])}
    if group.is_writer:
        if directory.exists():
            shutil.rmtree(directory)
        program.export(state, directory)


def score(
    recipe: Recipe,
    train_result: Path,
    examples_dir: Path,
    out_selected_export: Path | None = None,
    group: distributed.Group | None = None,
    *,
    quantized_base_dir: Path | None = None,
) -> dict:
    """DEV for every retained checkpoint, the DEV selection, TEST for the selected one.

    One checkpoint's state is held at a time (loaded, scored, dropped); the selected one is
    loaded again for TEST and, with ``out_selected_export``, its weights exported there.
    Returns ``checkpoints``, ``selection``, ``selected_dev`` and ``test``. With
    ``quantized_base_dir``, the base's codes are the product there (verified), as training
    read them.
    """
    from ..state import checkpoint

    group = group or distributed.Group()
    result = atomic.read_json(train_result)
    arrays, _ = examples.load(examples_dir, recipe.examples_digest)
    if quantized_base_dir is not None:
        try:
            product = quantized_base.load(quantized_base_dir, recipe.data)
        except quantized_base.QuantizedBaseError as exc:
            raise StageError(str(exc)) from None
        arrays = {**arrays, **product}
    program = recipe.strategy.build(recipe.data, arrays)
    restorer = _Restorer(program, recipe, group)
    rows = []
    for path in retained_checkpoints(Path(result["attempt_dir"])):
        try:
            state, manifest = restorer.load(path)
        except checkpoint.CheckpointError as exc:
            rows.append({"step": None, "path": str(path), "rejected": str(exc)})
            continue
        rows.append(
            {
                "step": manifest["step"],
                "path": str(path),
                "sha256": checkpoint.manifest_sha256(path),
                "state_hash": manifest["state_hash"],
                "dev": program.evaluate(state),
            }
        )
        del state  # before the next checkpoint is loaded
    scored = [r for r in rows if "dev" in r]
    if not scored:
        raise StageError(f"no verifiable checkpoint to evaluate for {result['attempt_dir']}")
    metric, mode = recipe.strategy.selection_metric
    sign = 1.0 if mode == "min" else -1.0
    # Best DEV score wins; among equals the later step (more training) wins.
    selected = min(scored, key=lambda r: (sign * r["dev"][metric], -r["step"]))
    path = Path(selected["path"])
    state, _ = restorer.load(path)  # verified again, and still the one DEV scored
    if checkpoint.manifest_sha256(path) != selected["sha256"]:
        raise StageError(f"{path} changed while it was being evaluated (manifest sha256)")
    test = program.evaluate_test(state)
    if out_selected_export is not None:
        _selected_export(program, state, out_selected_export, group)
    return {
        "checkpoints": rows,
        "selection": {
            "split": "dev",
            "metric": metric,
            "mode": mode,
            "step": selected["step"],
            "sha256": selected["sha256"],
        },
        "selected_dev": selected["dev"],
        "test": test,
    }
