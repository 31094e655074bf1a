"""The language-model program: a prepared recipe bound to its model, optimizer and update.

packed-sft runs it as it is; preference, grpo and two-stage fill in their parts
(:class:`LMProgram`). What it is made of lives in
the library: where training starts (:mod:`minifield.training.initial_state`), the rows of each
update (:mod:`minifield.data.batches`; a weighted mixture's draws,
:mod:`minifield.data.mixture`), the mesh and shardings of a data-parallel update
(:mod:`minifield.training.data_parallel`), evaluation (:mod:`minifield.training.evaluator`),
LoRA's frozen base and adapters (:mod:`minifield.training.lora`), and the export
(:mod:`.export_format`). The program holds them together and owns the state's life on the
device (:mod:`.placement`): created, placed, updated, evaluated, exported.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ...data.batches import MixtureBatches, TrainBatches
from ...hf import pinned_base
from ...training import lora
from ...training.evaluator import Evaluator
from ...training.initial_state import InitialState
from ..base import Program, compiled_memory
from . import export_format, model_section
from .placement import PlacedState, base_by_slices


class LMProgram(PlacedState, Program):
    """The base of every language-model strategy's program. What a strategy fills in, each a
    method it may override and nothing else: its optimizer (:meth:`make_optimizer`), its
    update (:meth:`make_step`, of :meth:`objective` and :attr:`accumulation` unless it
    writes its own), the rows of each update and their shapes (:meth:`make_batches`,
    :meth:`abstract_batch`, :meth:`out_shardings` for an update that returns more than
    its metrics), its evaluator (:meth:`make_evaluator`) and, for an update the program
    runs itself, :meth:`dispatch`. Placement, LoRA's frozen base, the mesh, the compiled
    update, evaluation's parameters and the export are the same for all."""

    #: the strategy identity an export records (None: packed-sft's; one built on this its own)
    export_strategy: dict | None = None
    exports_where_held = True
    #: what the objective's loss is a mean over (None: trained tokens,
    #: :class:`minifield.training.train_step.Accumulation`)
    accumulation = None
    #: why the update runs in one process (None: any number of processes)
    one_process: str | None = None

    def __init__(self, recipe: dict, arrays: dict[str, np.ndarray]):
        from ...models import device_memory, execution
        from ...training import data_parallel

        self.recipe, self.arrays = recipe, arrays
        training = recipe["training"]
        self.lora = lora.LoraSettings.from_recipe(recipe["model"])  # None: full fine-tuning
        self.tokenizer, _ = model_section.tokenizer_of(recipe, arrays)
        # how the model computes (attention kernel, scan, remat, loss chunks): execution.py
        cfg = model_section.config_of(recipe, arrays, self.tokenizer)
        # the policy and micro-batches: the recipe's, or what ``remat: auto`` chose for cfg
        memory_plan = device_memory.plan(cfg, recipe)
        self.memory_plan = memory_plan.describe()
        self.accum_steps = memory_plan.grad_accum_steps
        self.cfg = execution.with_recipe_options(cfg, device_memory.with_plan(recipe, memory_plan))
        self.seed = training["seed"]
        self.data_parallel = data_parallel.DataParallel.from_training(training)
        self.eval_every = recipe["evaluation"]["eval_every"]
        self.optimizer, schedule = self.make_optimizer()
        self.start = InitialState(self.cfg, self.optimizer, self.seed)
        if "base" in recipe["model"] and self.lora is None:
            self.base_params = pinned_base.params_from_arrays(arrays, base_by_slices(training))
        if self.lora is not None:
            self._lora_setup()
        self.batches = self.make_batches(arrays, training)
        self.examples_per_step = training["batch_size"]
        self.tokens_per_step = training["batch_size"] * training["seq_len"]
        head_dim = getattr(self.cfg, "head_dim", None) or self.cfg.d_model // self.cfg.n_heads
        self.attention = execution.attention_kernel(
            self.cfg.execution, training["seq_len"], head_dim
        )
        self._step_fn = self.make_step(schedule)
        self._compiled = None
        self._prefetcher = None  # started by the first dispatch
        self.layout = None  # set by lay_out_mesh(): the mesh and the state's shardings
        self.evaluator = self.make_evaluator()

    # -- what a strategy fills in --------------------------------------------------------------
    def make_optimizer(self) -> tuple:
        """``(optimizer, schedule)``, built once: the optimizer applies the schedule, the
        update reports its learning rate (a metric only, so the state, and its hash, are the
        same with or without it)."""
        from ...training import optimizer

        training, steps = self.recipe["training"], self.recipe["limits"]["max_steps"]
        schedule = optimizer.make_schedule(training, steps)
        return optimizer.make_optimizer(training, steps, schedule), schedule

    def objective(self):
        """``objective(params, cfg, batch) -> (loss, aux)`` the update differentiates."""
        from ...models.model import loss_fn

        return loss_fn

    def make_step(self, schedule):
        """The pure update, ``(state, batch) -> (state, metrics)``; with LoRA
        ``(state, base, batch)``, the frozen base an argument between them (never donated)."""
        from ...training import train_step

        how = self.accumulation or train_step.TOKEN_MEAN
        if self.lora is None:
            return train_step.make_train_step(
                self.cfg, self.optimizer, schedule, self.objective(), self.accum_steps, how
            )
        return lora.make_train_step(
            self.cfg, self.lora, self.optimizer, schedule, self.accum_steps, self.objective(), how
        )

    def make_batches(self, arrays: dict[str, np.ndarray], training: dict):
        """The rows of each update."""
        if "mixture" in training:
            return MixtureBatches(arrays, training)
        return TrainBatches(arrays, self.seed, training["batch_size"])

    def abstract_batch(self):
        """The update's batch as shapes and dtypes, what it is compiled for (update 0's)."""
        import jax

        return jax.tree_util.tree_map(
            lambda v: jax.ShapeDtypeStruct(v.shape, v.dtype), self.batches.batch(0)
        )

    def out_shardings(self) -> tuple:
        """The update's outputs on the mesh: the state as laid out, the metrics replicated."""
        return (self.layout.state, self.data_parallel.replicated(self.layout.mesh))

    def make_evaluator(self):
        return Evaluator(
            self.cfg,
            self.recipe["evaluation"]["batch_size"],
            self.tokenizer.eos_id,
            self.tokenizer.pad_id,
        )

    # -- the update ----------------------------------------------------------------------------
    def compile(self) -> None:
        """One executable for the whole update: with data parallelism, compiled for the mesh
        with the batch split over ``data`` and the state replicated (or sharded), donating
        the state's buffers. Without it (``devices: 1``) a plain single-device jit."""
        import jax

        if self.one_process is not None and jax.process_count() > 1:
            name = self.recipe["strategy"]["name"]
            raise RuntimeError(
                f"{name} runs in one process ({self.one_process}); start one process with "
                "training.data_parallel.devices of its devices"
            )
        abstract_state = jax.tree_util.tree_map(
            lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), self.start.abstract()
        )
        abstract_batch = self.abstract_batch()
        self.lay_out_mesh()
        shardings = {}
        if self.layout is not None:  # the batch's rows split over ``data``
            ins = (self.layout.state, self.layout.batch)
            if self.lora is not None:
                ins = (ins[0], self._base_shardings, ins[1])
            shardings = {"in_shardings": ins, "out_shardings": self.out_shardings()}
        fn = jax.jit(self._step_fn, donate_argnums=(0,), **shardings)
        base = () if self.lora is None else (_abstract(self._base),)
        step = fn.lower(abstract_state, *base, abstract_batch).compile()
        self.memory = compiled_memory(step)
        self._compiled = step if self.lora is None else lambda s, b: step(s, self._base, b)

    def step(self, state: dict) -> tuple[dict, dict[str, float]]:
        import jax

        new_state, read_metrics = self.dispatch(state, int(state["step"]))
        jax.block_until_ready(new_state)
        return new_state, read_metrics()

    def dispatch(self, state: dict, step: int):
        """Queue the update on the device and return at once: the batch was built ahead on
        the host (:class:`minifield.data.batch_prefetch.Prefetcher`), the metrics are read back
        when the caller asks for them (no device sync here)."""
        import jax

        from ...data.batch_prefetch import Prefetcher

        if self._compiled is None:
            self.compile()
        if self._prefetcher is None:
            self._prefetcher = Prefetcher(self.batches.with_counts)
        batch, counts = self._prefetcher.get(step)
        if self.layout is not None:
            batch = jax.device_put(batch, self.layout.batch)
        new_state, metrics = self._compiled(state, batch)
        return new_state, lambda: _host_metrics(metrics, counts)

    # -- evaluation and export -----------------------------------------------------------------
    def evaluate(self, state: dict) -> dict[str, float]:
        return self.evaluator.split_metrics(self._eval_params(state), self.arrays, "dev")

    def evaluate_test(self, state: dict) -> dict[str, float]:
        return self.evaluator.split_metrics(self._eval_params(state), self.arrays, "test")

    def export(self, state: dict, directory: Path, group=None) -> None:
        """:func:`export_format.write` (``group``: the processes writing it together)."""
        from ...models.layers import layer_stack

        params = layer_stack.per_layer(state["params"])  # scanned runs hold them stacked
        lora_run, fetch = None, None
        if self.lora is not None:
            lora_run, params, fetch = self._lora_export(params, group)
        export_format.write(
            directory,
            self.recipe,
            self.arrays,
            self.cfg,
            self.tokenizer,
            params,
            lora_run,
            self.export_strategy,
            self.export_files(),
            group,
            fetch,
        )

    def export_files(self) -> dict[str, bytes]:
        """Files the export carries besides the model and its DEV copy (none here)."""
        return {}


def _host_metrics(metrics: dict, counts: dict) -> dict[str, float]:
    """An update's metrics read back on the host (the scalars, ``tokens`` as ``loss_tokens``;
    a mixture of experts' ``expert_load`` as a list, one share per expert) beside the batch's
    counts: what ``dispatch`` returns the caller to ask for."""
    host = {k: float(v) for k, v in metrics.items() if np.ndim(v) == 0}
    if "expert_load" in metrics:
        host["expert_load"] = [float(share) for share in np.asarray(metrics["expert_load"])]
    host["loss_tokens"] = host.pop("tokens", float("nan"))
    return {**host, **counts}


def _abstract(tree):
    """``tree``'s arrays as shapes and dtypes, each in the memory it is placed in where that
    is not the device's (a base's table in the host's: the program reads it from there)."""
    import jax

    def one(a):
        kind = getattr(getattr(a, "sharding", None), "memory_kind", None)
        sharding = a.sharding if kind not in (None, "device") else None
        return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding)

    return jax.tree_util.tree_map(one, tree)
