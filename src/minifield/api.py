"""The Python API: validate a recipe and run one training attempt from a script.

    import minifield

    checked = minifield.validate("config/recipes/linear-demo.yaml")   # a path or a dict
    if checked.valid:
        result = minifield.run(checked, input_root="data", output_root="work/runs")
        print(result.status, result.final_state_hash, result.attempt_dir)

These are the worker's semantics without the process around it: ``run`` is what
``minifield-worker --job … --input-root … --output-root …`` does (the worker
command is a thin layer over this module), and ``RunResult.exit_code`` is the
code the worker would exit with (0 completed, 1 failed, 2 invalid job, inputs or
refused resume, 3 preempted, 4 limit reached, 5 I/O failure: the output could not be
written, resumable once there is room). Nothing here calls ``sys.exit``:
a refusal is a result with ``status == "invalid"``; only a programming error
(a wrong argument type) raises.

``load_model(path)`` loads a model to use (logits, generation, its tokenizer): an HF
directory or a minifield export (see :mod:`minifield.hf.loaded_model`).

Importing this module does not import JAX; ``run`` does, when it trains, and
``load_model`` does.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from . import atomic
from . import recipe as recipes
from .attempt.hash_cadence import HashCadence
from .attempt.layout import RESULT

if TYPE_CHECKING:
    from .attempt import train
    from .hf.loaded_model import LoadedModel
    from .supervision import distributed

__all__ = ["RunResult", "Validation", "load_model", "run", "run_problems", "validate"]

EXIT_COMPLETED, EXIT_FAILED, EXIT_INVALID, EXIT_PREEMPTED, EXIT_LIMIT = 0, 1, 2, 3, 4
EXIT_IO = 5
EXIT_DEVICE_BUSY = 6
#: status of a worker process that is not process 0 (which alone writes result.json), or of
#: an attempt whose result.json the disk did not take
_STATUS_OF_CODE = {
    EXIT_COMPLETED: "completed",
    EXIT_FAILED: "failed",
    EXIT_INVALID: "invalid",
    EXIT_PREEMPTED: "preempted",
    EXIT_LIMIT: "limit_reached",
    EXIT_IO: "io_failed",
    EXIT_DEVICE_BUSY: "device_busy",
}

RecipeLike = str | os.PathLike | Mapping[str, Any]


@dataclass(frozen=True)
class Validation:
    """The verdict on one recipe, as ``minifield-worker --validate-only`` prints it."""

    valid: bool
    #: sha256 of the computation-defining fields (None when invalid)
    computation_digest: str | None
    #: sha256 of the data-defining fields: recipes sharing it share prepared examples
    examples_digest: str | None
    #: ``{"name", "version"}`` of the strategy (as written, when the recipe is invalid)
    strategy: dict | None
    #: every problem: ``{"path": JSON pointer, "message": ...}``; empty when valid
    errors: list[dict] = field(default_factory=list)
    #: the file the recipe came from, or ``"<recipe>"`` for a dict
    source: str = "<recipe>"
    #: the validated recipe (defaults filled) that ``run`` trains; None when invalid
    recipe: recipes.Recipe | None = field(default=None, repr=False, compare=False)

    def to_json(self) -> dict:
        """The worker's ``--validate-only`` document."""
        if self.valid:
            return {
                "valid": True,
                "computation_digest": self.computation_digest,
                "examples_digest": self.examples_digest,
                "strategy": self.strategy,
            }
        return {
            "valid": False,
            "computation_digest": None,
            "strategy": self.strategy,
            "errors": self.errors,
        }

    def describe_errors(self) -> str:
        """Every problem on its own line, as the worker prints them."""
        return str(recipes.RecipeError(self.source, self.errors))


@dataclass(frozen=True)
class RunResult:
    """What one attempt ended with: its ``result.json`` plus the worker's exit code."""

    #: completed, failed, preempted, limit_reached, io_failed (the output could not be written:
    #: ``attempt_dir`` resumes once there is room), device_busy (another process held the
    #: accelerator: nothing trained); ``invalid`` when refused before an attempt
    status: str
    #: the code ``minifield-worker`` exits with for this outcome
    exit_code: int
    #: ``OUT/<job_id>/<attempt_id>/`` (None when refused before an attempt was opened)
    attempt_dir: Path | None
    computation_digest: str | None = None
    #: newest committed checkpoint ``{"step", "path", "sha256"}``, if any
    checkpoint: dict | None = None
    #: sha256 of the complete state after the last update (completed attempts)
    final_state_hash: str | None = None
    steps_completed: int | None = None
    metrics: dict = field(default_factory=dict)
    #: ``{"phase", "message"}`` of a failure, limit or refusal; None when completed
    error: dict | None = None
    #: the whole ``result.json`` (None when none was written: refused, or not process 0)
    result: dict | None = field(default=None, repr=False)

    @property
    def ok(self) -> bool:
        return self.exit_code == EXIT_COMPLETED


def _load(recipe: RecipeLike | Validation | recipes.Recipe) -> Validation:
    if isinstance(recipe, Validation):
        return recipe
    if isinstance(recipe, recipes.Recipe):
        return _verdict(recipe, "<recipe>")
    if isinstance(recipe, Mapping):
        source, document = "<recipe>", dict(recipe)
        try:
            return _verdict(recipes.validate(document, source), source)
        except recipes.RecipeError as exc:
            return _refused(exc, document)
    if isinstance(recipe, str | os.PathLike):
        source = str(recipe)
        try:
            return _verdict(recipes.load(recipe), source)
        except recipes.RecipeError as exc:
            try:
                document = recipes.read_document(recipe)
            except recipes.RecipeError:
                document = None
            return _refused(exc, document)
    raise TypeError(f"a recipe is a path, a mapping or a Validation, not {type(recipe).__name__}")


def _verdict(recipe: recipes.Recipe, source: str) -> Validation:
    return Validation(
        valid=True,
        computation_digest=recipe.computation_digest,
        examples_digest=recipe.examples_digest,
        strategy={"name": recipe.strategy.name, "version": recipe.strategy.version},
        source=source,
        recipe=recipe,
    )


def _refused(exc: recipes.RecipeError, document: Any) -> Validation:
    spec = document.get("strategy") if isinstance(document, dict) else None
    return Validation(
        valid=False,
        computation_digest=None,
        examples_digest=None,
        strategy=spec if isinstance(spec, dict) else None,
        errors=list(exc.errors),
        source=exc.source,
    )


def validate(recipe: RecipeLike) -> Validation:
    """Validate a recipe file (JSON or YAML) or an already parsed recipe (a dict).

    Never raises for a bad recipe: ``valid`` is False and ``errors`` names every
    problem with its JSON pointer. Does not import JAX.
    """
    return _load(recipe)


def run_problems(
    input_root: str | os.PathLike,
    *,
    resume_from: str | os.PathLike | None = None,
    stop_after_step: int | None = None,
    faults: train.Faults | None = None,
) -> list[str]:
    """What makes these run arguments unusable, before anything starts (the worker checks
    them before joining other processes)."""
    problems = []
    if not Path(input_root).is_dir():
        problems.append(f"--input-root {input_root} is not a directory")
    steps = {"stop_after_step": stop_after_step}
    if faults is not None:
        steps.update(
            fail_after_step=faults.fail_after_step,
            stall_after_step=faults.stall_after_step,
            kill_during_checkpoint=faults.kill_during_checkpoint,
        )
    for name, value in steps.items():
        if value is not None and value < 1:
            problems.append(f"--{name.replace('_', '-')} must be >= 1 (got {value})")
    if resume_from is not None and not Path(resume_from).is_dir():
        problems.append(f"--resume-from {resume_from} is not a directory")
    return problems


def _invalid(message: str, phase: str, computation_digest: str | None = None) -> RunResult:
    return RunResult(
        status="invalid",
        exit_code=EXIT_INVALID,
        attempt_dir=None,
        computation_digest=computation_digest,
        error={"phase": phase, "message": message},
    )


def run(
    recipe: RecipeLike | Validation,
    *,
    input_root: str | os.PathLike,
    output_root: str | os.PathLike,
    resume_from: str | os.PathLike | None = None,
    attempt_id: str | None = None,
    examples_dir: str | os.PathLike | None = None,
    quantized_base_dir: str | os.PathLike | None = None,
    allow_environment_change: bool = False,
    record_state_hashes: bool | int | str = False,
    compilation_cache: str | os.PathLike | None = None,
    stop_after_step: int | None = None,
    faults: train.Faults | None = None,
    group: distributed.Group | None = None,
) -> RunResult:
    """Run one training attempt of ``recipe`` into ``OUTPUT_ROOT/<job_id>/<attempt_id>/``.

    ``record_state_hashes`` is the per-update state-hash cadence: ``True`` or ``1`` (every
    update), an integer K (every K-th), ``False`` or ``"checkpoint"`` (none: the checkpoint
    manifests carry the hash).

    The same as ``minifield-worker --job RECIPE --input-root … --output-root …``
    with the matching options; the result is the attempt's ``result.json``.
    A recipe or argument the worker refuses gives ``status == "invalid"``
    (``exit_code`` 2, ``error`` says why) and writes nothing. ``faults`` (fault
    injection) and ``group`` (the processes of a multi-process attempt) are for
    the worker command and the recovery proof.
    """
    checked = _load(recipe)
    if not checked.valid:
        return _invalid(checked.describe_errors(), "validate")
    problems = run_problems(
        input_root, resume_from=resume_from, stop_after_step=stop_after_step, faults=faults
    )
    try:
        HashCadence.parse(record_state_hashes)
    except ValueError as exc:
        problems.append(f"record_state_hashes: {exc}")
    if problems:
        return _invalid("; ".join(problems), "arguments", checked.computation_digest)

    from .attempt import train  # JAX: only when training

    given = {"faults": faults, "group": group}
    options = train.Options(
        input_root=Path(input_root),
        output_root=Path(output_root),
        resume_from=None if resume_from is None else Path(resume_from),
        attempt_id=attempt_id,
        examples_dir=None if examples_dir is None else Path(examples_dir),
        quantized_base_dir=None if quantized_base_dir is None else Path(quantized_base_dir),
        allow_environment_change=allow_environment_change,
        record_state_hashes=record_state_hashes,
        compilation_cache=None if compilation_cache is None else Path(compilation_cache),
        stop_after_step=stop_after_step,
        **{name: value for name, value in given.items() if value is not None},
    )
    try:
        code, attempt_dir, error = train.run(checked.recipe, options)
    except train.ResumeRefused as exc:
        return _invalid(str(exc), "resume", checked.computation_digest)
    except OSError as exc:
        # the attempt directory could not be created under the output root
        message = f"cannot open an attempt under {output_root}: {exc}"
        if atomic.is_io_failure(exc):  # a full disk, not a bad output root: nothing written
            return RunResult(
                status="io_failed",
                exit_code=EXIT_IO,
                attempt_dir=None,
                computation_digest=checked.computation_digest,
                error={"phase": "open", "message": message},
            )
        return _invalid(message, "open", checked.computation_digest)
    result_path = attempt_dir / RESULT
    if not options.group.is_writer or not result_path.is_file():
        return RunResult(
            status=_STATUS_OF_CODE.get(code, "failed"),
            exit_code=code,
            attempt_dir=attempt_dir,
            computation_digest=checked.computation_digest,
            error=error if options.group.is_writer else None,
        )
    result = json.loads(result_path.read_text(encoding="utf-8"))
    return RunResult(
        status=result["status"],
        exit_code=code,
        attempt_dir=attempt_dir,
        computation_digest=result.get("computation_digest"),
        checkpoint=result.get("checkpoint"),
        final_state_hash=result.get("final_state_hash"),
        steps_completed=result.get("steps_completed"),
        metrics=result.get("metrics") or {},
        error=result.get("error"),
        result=result,
    )


def load_model(path: str | os.PathLike, *, compute_dtype: str | None = None) -> LoadedModel:
    """A model ready to use, from ``path``: a minifield export (a directory with
    ``model.json``: its weights, tokenizer and prompt layout, checked against their sha256)
    or any supported HF directory (``config.json`` + safetensors weights + ``tokenizer.json``
    and ``tokenizer_config.json``, optionally ``generation_config.json``).

    The result has ``.logits(token_ids)`` (``[T]`` -> ``[T, V]``, ``[B, T]`` -> ``[B, T, V]``,
    FP32 numpy), ``.generate(prompt_or_messages, max_new_tokens, temperature=, top_k=,
    top_p=, seed=, chat_template=)`` (text), ``.prompt_ids``, ``.generate_ids``,
    ``.tokenizer``, ``.template`` (the chat template, or None) and ``.stop_ids``.
    ``compute_dtype``: ``float32`` or ``bfloat16``; None keeps an export's own and computes
    an HF directory in ``float32``. Raises ``ModelLoadError`` (a ``ValueError``) naming the
    file and field for anything that cannot be loaded.
    """
    from .data.tokenizer import TokenizerError
    from .hf import config as hf_config
    from .hf import loaded_model
    from .inputs.pinned import InputError
    from .state.export import MODEL_FILE, ExportError
    from .strategies.lm import export_format

    if compute_dtype not in (None, "float32", "bfloat16"):
        raise ValueError(f"compute_dtype must be 'float32' or 'bfloat16', got {compute_dtype!r}")
    directory = Path(path)
    if not directory.is_dir():
        raise loaded_model.ModelLoadError(f"{directory}: not a directory")
    if not (directory / MODEL_FILE).exists():
        if not (directory / hf_config.CONFIG_FILE).exists():
            raise loaded_model.ModelLoadError(
                f"{directory}: neither a minifield export ({MODEL_FILE} missing) nor an HF "
                f"model directory ({hf_config.CONFIG_FILE} missing)"
            )
        return loaded_model.from_hf_directory(directory, compute_dtype or "float32")
    try:
        model = export_format.ExportedModel(directory)
    except (ExportError, InputError, TokenizerError, ValueError, OSError) as exc:
        raise loaded_model.ModelLoadError(str(exc)) from None
    return model if compute_dtype is None else model.with_compute_dtype(compute_dtype)
