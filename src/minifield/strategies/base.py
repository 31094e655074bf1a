"""What a training strategy provides to the worker, the pipeline and the store.

A strategy is one kind of computation (``linear-momentum 1.0.0``,
``packed-sft 12.0.0``). It owns the schema of the recipe sections ``model``,
``training`` and ``evaluation``, turns pinned input files into examples, and
builds a :class:`Program`: the compiled pure functions over the complete state.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from .. import schemas
from ..digest import sha256_json
from ..hf import quantized_base
from ..models import execution

#: an input entry's keys that say how its rows are read (absent from most recipes, so
#: only a recipe that gives one has them in its digests)
READING_KEYS = ("format", "columns", "roles")
#: recipe sections only some strategies have (``Strategy.extra_sections``); in the
#: computation digest only when given, so every other recipe keeps its digest
EXTRA_SECTIONS = ("preference", "rl")


def pinned_inputs(data: dict) -> list[dict]:
    """Each input's name and sha256, with how it is read where the recipe says, by name."""
    return sorted(
        (
            {"name": i["name"], "sha256": i["sha256"], **{k: i[k] for k in READING_KEYS if k in i}}
            for i in data["inputs"]
        ),
        key=lambda i: i["name"],
    )


def computation_fields(data: dict) -> dict:
    """What defines a validated recipe's computation: not ids, roots, runtime placement or
    operational limits. Its digest is the computation digest (the recipe's identity, and
    what an export of a two-stage computation records)."""
    fields = {
        "strategy": data["strategy"],
        "inputs": pinned_inputs(data),
        "model": data["model"],
        "training": data["training"],
        "limits": {"max_steps": data["limits"]["max_steps"]},
        "evaluation": data["evaluation"],
    }
    fields.update({key: data[key] for key in EXTRA_SECTIONS if key in data})
    quantized = quantized_base.digest(data)
    if quantized is not None:  # the product it trains on, named (absent: every other recipe)
        fields["quantized_base"] = quantized
        kernel = execution.quantized_kernel(
            data.get("runtime", {}).get("backend", "any"),
            data["model"].get("compute_dtype", "bfloat16"),
        )
        if kernel != "xla":  # another summation order (absent: XLA's, every recipe so far)
            fields["quantized_kernel"] = kernel
    return fields


def computation_digest(data: dict) -> str:
    return sha256_json(computation_fields(data))


class Program(ABC):
    """A recipe bound to its examples: init, one update, evaluation, export."""

    #: examples consumed by one update (for throughput figures)
    examples_per_step: int = 0
    #: tokens consumed by one update (0 when the workload has no tokens)
    tokens_per_step: int = 0

    @abstractmethod
    def init_state(self) -> dict:
        """Fresh complete state (params, opt_state, rng, step, cursor) for step 0."""

    def state_template(self) -> Any:
        """What a checkpoint is restored into (``state.checkpoint.load``): the state's structure,
        shapes, dtypes and where each array will live. The default is a fresh state (cheap for
        a small program); a program whose state is large answers with abstract arrays
        (``jax.ShapeDtypeStruct``, with the sharding it will have), so a restore holds the
        restored state alone, never a second one beside it."""
        return self.init_state()

    def attach(self, attempt_dir: Path) -> None:
        """The attempt's directory, for a program that keeps files of its own there (grpo's
        rollouts); called on the writing process only, before ``compile``. The default keeps
        nothing."""
        return None

    @abstractmethod
    def compile(self) -> None:
        """Compile the update ahead of time from abstract shapes (consumes no state)."""

    #: where the compiled update runs (data-parallel mesh and sharding counts), reported in
    #: the ``compiled`` event; None for a plain single-device update
    placement: dict | None = None
    #: the attention kernel the update runs and its block sizes
    #: (``models.execution.attention_kernel``), reported in the ``compiled`` event; None
    #: for a program without attention
    attention: dict | None = None
    #: the compiled update's memory analysis (:func:`compiled_memory`), reported in the
    #: ``compiled`` event; None where the backend gives none
    memory: dict | None = None
    #: the update's remat policy and micro-batches (``models.device_memory.Plan``: the
    #: recipe's, or what ``training.remat: auto`` chose), reported in the ``compiled`` event;
    #: None for a program without them
    memory_plan: dict | None = None

    def place(self, state: dict) -> dict:
        """Put a fresh or restored state where the compiled update expects it.

        The worker calls this once after ``init_state`` or a checkpoint restore (whose arrays
        are plain host-loaded arrays) and before the first ``step``. A data-parallel program
        returns the state sharded or replicated over its device mesh; the default returns it
        unchanged.
        """
        return state

    @abstractmethod
    def step(self, state: dict) -> tuple[dict, dict[str, float]]:
        """One update; returns the new state and host metrics after the device finished."""

    def dispatch(self, state: dict, step: int) -> tuple[dict, Callable[[], dict[str, float]]]:
        """Start update ``step + 1`` from ``state`` (at ``step``) without waiting for it.

        Returns the new state (arrays the device may still be computing) and a function that
        waits for the update and returns its host metrics. The update loop calls that
        function only after the next update is queued, so the device does not idle while
        the host reads and reports. The default is the synchronous ``step``.
        """
        new_state, metrics = self.step(state)
        return new_state, lambda: metrics

    #: run a periodic evaluation every this many updates (0: only at the end)
    eval_every: int = 0

    @abstractmethod
    def evaluate(self, state: dict) -> dict[str, float]:
        """Metrics of the state's parameters on the DEV data (used for checkpoint selection)."""

    def evaluate_test(self, state: dict) -> dict[str, float]:
        """Metrics on the TEST data; assessed only for the DEV-selected checkpoint."""
        return {}

    #: whether :meth:`export` takes a ``group`` and a state spread over several processes as
    #: it lives (every process calls it, each writes what its devices hold); else a
    #: multi-process attempt copies the state to every host and process 0 exports it
    exports_where_held: bool = False

    @abstractmethod
    def export(self, state: dict, directory: Path) -> None:
        """Write loadable final weights and the config needed to use them."""


class Strategy(ABC):
    name: str
    version: str
    description: str
    default_max_steps: int
    default_every_steps: int
    #: (metric, "min" | "max") used to select a checkpoint on DEV
    selection_metric: tuple[str, str]
    #: part of the examples digest (:meth:`data_spec`): bumped when the same files prepare
    #: otherwise, so that examples prepared by older code are never reused
    prepare_version: int = 1
    #: the recipe sections of :data:`EXTRA_SECTIONS` this strategy has (its schema's)
    extra_sections: tuple[str, ...] = ()
    #: whether prepare checks a pinned base's step against ``runtime.device_memory_bytes``
    #: (:mod:`minifield.models.device_memory` estimates packed-sft's step alone)
    estimates_step_memory: bool = False

    @property
    def schema_file(self) -> str:
        """The file under minifield/schemas/ validating model/training/evaluation (with
        defaults): named after the strategy."""
        return schemas.strategy_file(self.name)

    def describe(self) -> dict:
        return {"name": self.name, "version": self.version, "description": self.description}

    def devices_required(self, recipe: dict) -> int:
        """Devices the recipe's computation is defined over: its data-parallel degree
        (``training.data_parallel.devices``), 1 for a strategy whose schema has none."""
        return recipe.get("training", {}).get("data_parallel", {}).get("devices", 1)

    def check(self, recipe: dict) -> list[dict]:
        """Cross-field checks the schema cannot express; each error has ``path`` and ``message``."""
        return []

    @abstractmethod
    def data_spec(self, recipe: dict) -> dict:
        """The data-defining part of the recipe: what the examples digest covers."""

    @abstractmethod
    def prepare(self, recipe: dict, files: dict[str, Path]) -> tuple[dict[str, np.ndarray], dict]:
        """Turn verified input files (by input name) into example arrays plus metadata.

        A strategy with :meth:`training_sources` also takes ``sources=``: those sources
        already prepared (input name → ``(arrays, meta)`` of :meth:`prepare_source`)."""

    def training_sources(self, recipe: dict) -> dict[str, dict]:
        """Training inputs prepared each on its own, so that recipes sharing one reuse its
        prepared rows: input name → the data spec of that source alone (its sha256 is the
        source digest, ``results/sources/{sdigest}/``). Empty (the default): the examples are
        prepared in one piece."""
        return {}

    def prepare_source(
        self, recipe: dict, name: str, files: dict[str, Path]
    ) -> tuple[dict[str, np.ndarray], dict]:
        """Prepare one of :meth:`training_sources` on its own: arrays plus metadata."""
        raise NotImplementedError(f"{self.name} prepares no training source on its own")

    def unknown_tokens(self, recipe: dict, files: dict[str, Path]) -> dict[str, dict]:
        """The recipe's data files (verified inputs by name) read and encoded as :meth:`prepare`
        does, for what it refuses of text the tokenizer cannot spell (``DataError``,
        :mod:`minifield.data.unknown_text`), or else counts: input name → its count. Empty
        (the default): nothing of the kind to check."""
        return {}

    @abstractmethod
    def build(self, recipe: dict, examples: dict[str, np.ndarray]) -> Program:
        """Bind the recipe to prepared examples."""

    @abstractmethod
    def acceptance(self, recipe: dict, metrics: dict[str, Any]) -> dict:
        """``{"passed": bool, "checks": [{name, value, threshold, passed}]}`` for the metrics."""

    @abstractmethod
    def evaluate_export(self, recipe: dict, export_dir: Path) -> dict[str, Any]:
        """Re-run the acceptance evaluation from exported weights alone (used by the store)."""


def compiled_memory(compiled) -> dict | None:
    """A compiled program's memory analysis in bytes: its arguments, outputs, temporaries,
    the outputs aliased to donated arguments, and ``peak`` = arguments + outputs +
    temporaries - aliased: what the device holds at most while it runs (a device's own
    ``peak_bytes_in_use`` misses the temporaries; docs/tpu.md, "Memory on the chip"). None
    where the backend gives no analysis."""
    analysis = compiled.memory_analysis()
    if analysis is None:
        return None
    parts = {
        "arguments": analysis.argument_size_in_bytes,
        "outputs": analysis.output_size_in_bytes,
        "temporaries": analysis.temp_size_in_bytes,
        "aliased": analysis.alias_size_in_bytes,
    }
    parts = {name: int(value) for name, value in parts.items()}
    peak = parts["arguments"] + parts["outputs"] + parts["temporaries"] - parts["aliased"]
    return {**parts, "peak": peak}
