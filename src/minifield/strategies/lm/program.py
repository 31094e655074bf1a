"""The language-model program: a prepared recipe bound to its model, optimizer and update.

packed-sft runs it as it is; preference and two-stage build on it. What it is made of lives in
the library: where training starts (:mod:`minifield.training.initial_state`), the rows of each
update (:mod:`minifield.data.batches`; a weighted mixture's draws,
:mod:`minifield.data.mixture`), the mesh and shardings of a data-parallel update
(:mod:`minifield.training.data_parallel`), evaluation (:mod:`minifield.training.evaluator`),
LoRA's frozen base and adapters (:mod:`minifield.training.lora`), and the export
(:mod:`.export_format`). The program holds them together and owns the state's life on the
device: created, placed, updated, evaluated, exported.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ...data import mixture
from ...data.batches import MixtureBatches, TrainBatches
from ...hf import pinned_base
from ...training import lora
from ...training.evaluator import Evaluator
from ...training.initial_state import InitialState
from ..base import Program
from . import export_format, model_section


class LMProgram(Program):
    #: the strategy identity an export records (None: packed-sft's; one built on this its own)
    export_strategy: dict | None = None
    exports_where_held = True

    def __init__(self, recipe: dict, arrays: dict[str, np.ndarray]):
        from ...models import execution
        from ...training import data_parallel, optimizer, train_step

        self.recipe, self.arrays = recipe, arrays
        training = recipe["training"]
        self.lora = lora.LoraSettings.from_recipe(recipe["model"])  # None: full fine-tuning
        self.tokenizer, _ = model_section.tokenizer_of(recipe, arrays)
        # how the model computes (attention kernel, scan, remat, loss chunks): execution.py
        cfg = model_section.config_of(recipe, arrays, self.tokenizer)
        self.cfg = execution.with_recipe_options(cfg, recipe)
        self.seed = training["seed"]
        self.batches = self.make_batches(arrays, training)
        self.accum_steps = mixture.grad_accum_steps(training)
        self.examples_per_step = training["batch_size"]
        self.tokens_per_step = training["batch_size"] * training["seq_len"]
        self.eval_every = recipe["evaluation"]["eval_every"]
        # built once: the optimizer applies it, the update reports its learning rate (a
        # metric only, so the state, and its hash, are the same with or without it)
        schedule = optimizer.make_schedule(training, recipe["limits"]["max_steps"])
        self.optimizer = optimizer.make_optimizer(training, recipe["limits"]["max_steps"], schedule)
        self._step_fn = train_step.make_train_step(
            self.cfg, self.optimizer, schedule, accum_steps=self.accum_steps
        )
        self.start = InitialState(self.cfg, self.optimizer, self.seed)
        if "base" in recipe["model"] and self.lora is None:
            self.base_params = pinned_base.params_from_arrays(arrays, _base_by_slices(training))
        if self.lora is not None:
            self._lora_setup(schedule)
        self._compiled = None
        self._prefetcher = None  # started by the first dispatch
        self.data_parallel = data_parallel.DataParallel.from_training(training)
        self.layout = None  # set by lay_out_mesh(): the mesh and the state's shardings
        self.evaluator = Evaluator(
            self.cfg,
            recipe["evaluation"]["batch_size"],
            self.tokenizer.eos_id,
            self.tokenizer.pad_id,
        )

    def make_batches(self, arrays: dict[str, np.ndarray], training: dict):
        """The rows of each update (a strategy that makes its own batches overrides it)."""
        if "mixture" in training:
            return MixtureBatches(arrays, training)
        return TrainBatches(arrays, self.seed, training["batch_size"])

    def _lora_setup(self, schedule) -> None:
        """LoRA: the step trains the adapters against the frozen base (held once as its
        checkpoint stores it, seen in ``base_dtype``: :mod:`minifield.hf.stored_base`);
        evaluation runs on the merged weights."""
        import jax

        self._base = _frozen_base(self.arrays, self.recipe["training"], self.lora.base_dtype)
        inputs = model_section.base_model_inputs(self.recipe["model"])
        self.start.lora_run = (self.lora, lora.base_identity(self.recipe, inputs))
        self._step_fn = lora.make_train_step(
            self.cfg, self.lora, self.optimizer, schedule, self.accum_steps
        )
        self._merge = jax.jit(lambda base, adapters: lora.merged(base, adapters, self.lora))

    # -- the state: created, placed ------------------------------------------------------------
    @property
    def base_params(self):
        """Host FP32 weights training starts from (a base model's), or None: at random."""
        return self.start.base_params

    @base_params.setter
    def base_params(self, params) -> None:
        self.start.base_params = params

    def init_state(self) -> dict:
        if self.layout is not None:
            return self.start.on_mesh(self.layout.state)
        return self.start.on_one_device()

    def state_template(self) -> dict:
        """The step-0 state as shapes and dtypes (``InitialState.abstract``: nothing computed,
        no base weight converted), each leaf with its sharding once the mesh is laid out: a
        restore reads only this process's regions and holds no template state beside them."""
        import jax

        abstract = self.start.abstract()
        if self.layout is None:
            return jax.tree_util.tree_map(
                lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), abstract
            )
        return jax.tree_util.tree_map(
            lambda a, sharding: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding),
            abstract,
            self.layout.state,
        )

    def lay_out_mesh(self) -> None:
        """The data-parallel mesh and the shardings of the state and the batch, without
        compiling the update (``compile`` starts with it; a no-op on one device or done
        twice). From then on ``init_state`` creates the state in its shardings and
        evaluation runs on the mesh; before, a one-device state (the template a process that
        only evaluates checkpoints restores into)."""
        dp = self.data_parallel
        if self.layout is not None or dp.devices == 1:
            return
        self.layout = dp.lay_out(self.start.abstract())
        if self.lora is not None:  # the frozen base on the mesh too, as its own shardings
            self._base, self._base_shardings = _base_on_mesh(dp, self.layout.mesh, self._base)
        self.evaluator.on_mesh(self.layout.batch, dp.devices)
        self.placement = self.layout.placement()

    def place(self, state: dict) -> dict:
        """Put a fresh or restored state on the mesh with the compiled step's shardings: a
        fresh state is already there (``init_state``), a restored one arrives as host arrays
        and each device receives only its slices (``parallel.place``)."""
        from ...training import data_parallel

        self.lay_out_mesh()
        return state if self.layout is None else data_parallel.place_tree(state, self.layout.state)

    # -- the update ----------------------------------------------------------------------------
    def compile(self) -> None:
        """One executable for the whole update: with data parallelism, compiled for the mesh
        with the batch split over ``data`` and the state replicated (or sharded), donating
        the state's buffers. Without it (``devices: 1``) a plain single-device jit."""
        import jax

        abstract_state, abstract_batch = _abstract_arguments(self.start, self.batches)
        self.lay_out_mesh()
        shardings = _update_shardings(self.layout, self.data_parallel, abstract_batch)
        if self.lora is not None:  # the frozen base an argument (never donated)
            if shardings:  # between the state and the batch
                shardings["in_shardings"] = _with_base(shardings, self._base_shardings)
            fn = jax.jit(self._step_fn, donate_argnums=(0,), **shardings)
            abstract_base = jax.eval_shape(lambda: self._base)
            step = fn.lower(abstract_state, abstract_base, abstract_batch).compile()
            self._compiled = lambda state, batch: step(state, self._base, batch)
            return
        fn = jax.jit(self._step_fn, donate_argnums=(0,), **shardings)
        self._compiled = fn.lower(abstract_state, abstract_batch).compile()

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
    def _eval_params(self, state: dict):
        """The parameters evaluation runs with. On a data-parallel mesh they stay in the
        state's shardings (a host copy, which the end of a multi-process attempt passes, is
        placed there slice by slice): never gathered onto one device, so a model that needs
        ``shard_params`` to fit is evaluated as it trains. Per layer: a scanned run's state
        holds its blocks stacked (``layer_stack``)."""
        from ...models.layers import layer_stack
        from ...training import data_parallel

        if self.lora is not None:  # the merged FP32 weights, as the export holds them
            return self._merge(self._base, state["params"])
        if self.layout is None:
            return layer_stack.per_layer(state["params"])
        return layer_stack.per_layer(
            data_parallel.place_tree(state["params"], self.layout.state["params"])
        )

    def evaluate(self, state: dict) -> dict[str, float]:
        return self.evaluator.split_metrics(self._eval_params(state), self.arrays, "dev")

    def evaluate_test(self, state: dict) -> dict[str, float]:
        return self.evaluator.split_metrics(self._eval_params(state), self.arrays, "test")

    def export(self, state: dict, directory: Path, group=None) -> None:
        """:func:`export_format.write` (``group``: the processes writing it together)."""
        from ...models.layers import layer_stack

        params = layer_stack.per_layer(state["params"])  # scanned runs hold them stacked
        lora_run = None
        if self.lora is not None:
            lora_run, params = (self.lora, params), self._merge(self._base, params)
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
        )

    def export_files(self) -> dict[str, bytes]:
        """Files the export carries besides the model and its DEV copy (none here)."""
        return {}


def _base_by_slices(training: dict) -> bool:
    """Whether a base's FP32 masters are converted slice by slice as they are placed: on a
    mesh that shards them (each process converts only its devices' slices)."""
    from ...training import data_parallel

    dp = data_parallel.DataParallel.from_training(training)
    return dp.devices > 1 and dp.shard_params


def _abstract_arguments(start: InitialState, batches) -> tuple[dict, dict]:
    """The update's state and batch as shapes and dtypes, what it is compiled for: the state
    a single device would start from, the batch of update 0."""
    import jax

    abstract_state = jax.tree_util.tree_map(
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype),
        start.abstract(),
    )
    batch = batches.batch(0)
    abstract_batch = {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in batch.items()}
    return abstract_state, abstract_batch


def _host_metrics(metrics: dict, counts: dict) -> dict[str, float]:
    """An update's metrics read back on the host (the scalars, ``tokens`` as ``loss_tokens``;
    a mixture of experts' ``expert_load`` as a list, one share per expert) beside the batch's
    counts: what ``dispatch`` returns the caller to ask for."""
    host = {k: float(v) for k, v in metrics.items() if np.ndim(v) == 0}
    if "expert_load" in metrics:
        host["expert_load"] = [float(share) for share in np.asarray(metrics["expert_load"])]
    host["loss_tokens"] = host.pop("tokens", float("nan"))
    return {**host, **counts}


def _update_shardings(layout, data_parallel, abstract_batch: dict) -> dict:
    """``jax.jit``'s shardings of the update on the mesh: the batch split over ``data``, the
    state as laid out, the metrics replicated; none on one device."""
    if layout is None:
        return {}
    batch_shardings = {k: layout.batch for k in abstract_batch}
    return {
        "in_shardings": (layout.state, batch_shardings),
        "out_shardings": (layout.state, data_parallel.replicated(layout.mesh)),
    }


def _frozen_base(arrays: dict, training: dict, base_dtype: str):
    """LoRA's frozen base as stored: on the device, or, for a data-parallel run, the host's
    arrays, which ``lay_out_mesh`` places on the mesh slice by slice (never whole on one
    device first)."""
    from ...hf import stored_base
    from ...training.data_parallel import DataParallel

    if DataParallel.from_training(training).devices == 1:
        return stored_base.on_device(arrays, base_dtype)
    return stored_base.on_host(arrays, base_dtype)


def _base_on_mesh(dp, mesh, base) -> tuple:
    """LoRA's frozen base placed on the mesh by the state's rule (replicated, or split under
    ``shard_params``), and its shardings."""
    from ...training import data_parallel

    shardings = dp.state_shardings(mesh, {"params": base})["params"]
    return data_parallel.place_tree(base, shardings), shardings


def _with_base(shardings: dict, base_shardings) -> tuple:
    """The LoRA update's input shardings: the state's, the frozen base's, the batch's."""
    state_in, batch_in = shardings["in_shardings"]
    return (state_in, base_shardings, batch_in)
