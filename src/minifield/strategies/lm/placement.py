"""The state of a language-model program on its devices: created, placed on the data-parallel
mesh, LoRA's frozen base beside it, and the parameters evaluation and the export read.

:class:`PlacedState` is the part of :class:`minifield.strategies.lm.program.LMProgram` that
every strategy shares unchanged (the program sets ``recipe``, ``arrays``, ``lora``,
``start``, ``data_parallel``, ``layout`` and ``evaluator``; what a strategy fills in is the
program's).
"""

from __future__ import annotations

from ...training import lora
from . import model_section


class PlacedState:
    def _lora_setup(self) -> None:
        """LoRA: the step trains the adapters against the frozen base (held once as its
        checkpoint stores it, seen in ``base_dtype``: :mod:`minifield.hf.stored_base`);
        evaluation runs on the merged weights, or, on a quantized base, on the base as the
        step holds it (:meth:`_lora_params`)."""
        import jax

        how = self.cfg.execution
        self._base = frozen_base(self.arrays, self.recipe["training"], self.lora, how.scan_layers)
        inputs = model_section.base_model_inputs(self.recipe["model"])
        self.start.lora_run = (self.lora, lora.base_identity(self.recipe, inputs))
        self._merge = jax.jit(lambda base, adapters: lora.merged(base, adapters, self.lora))

    def _lora_params(self, adapters: dict):
        """The parameters a LoRA run's model is evaluated (and GRPO's policy sampled) with
        (a quantized base is packed-sft's only, its schema's key):
        the merged FP32 weights, as the export holds them; on a quantized base, the base as
        the step holds it (its codes, each layer's matrices made back inside that layer's
        products) with the adapters beside it, as training's forward runs: the device holds
        no unquantized copy of the base (an 8B base on a 16 GB chip does not fit one)."""
        if self.lora.quantization is not None:
            return lora.adapted(self._base, adapters, self.lora)
        return self._merge(self._base, adapters)

    def _lora_export(self, adapters: dict, group) -> tuple:
        """``(lora_run, params, fetch)`` the export writes: the merged weights made on the
        host tensor by tensor (:class:`minifield.training.host_merge.HostMerge`: never the base
        on the device); over several processes (``group``), each process's own slices merged
        on their mesh (``fetch`` None)."""
        if group is None:
            from ...training.host_merge import HostMerge

            merge = HostMerge(self.arrays, adapters, self.lora)
            return (self.lora, adapters), merge.params, merge.value
        return (self.lora, adapters), self._merge(self._base, adapters), None

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
            self._base, self._base_shardings = base_on_mesh(dp, self.layout.mesh, self._base)
        self.evaluator.on_mesh(self.layout.batch, dp.devices)
        self.placement = self.layout.placement()

    def place(self, state: dict) -> dict:
        """Put a fresh or restored state on the mesh with the compiled step's shardings: a
        fresh state is already there (``init_state``), a restored one arrives as host arrays
        and each device receives only its slices (``parallel.place``)."""
        from ...training import data_parallel

        self.lay_out_mesh()
        return state if self.layout is None else data_parallel.place_tree(state, self.layout.state)

    def _eval_params(self, state: dict):
        """The parameters evaluation runs with. On a data-parallel mesh they stay in the
        state's shardings (a host copy, which the end of a multi-process attempt passes, is
        placed there slice by slice): never gathered onto one device, so a model that needs
        ``shard_params`` to fit is evaluated as it trains. Per layer: a scanned run's state
        holds its blocks stacked (``layer_stack``)."""
        from ...models.layers import layer_stack
        from ...training import data_parallel

        if self.lora is not None:
            return self._lora_params(state["params"])
        if self.layout is None:
            return layer_stack.per_layer(state["params"])
        return layer_stack.per_layer(
            data_parallel.place_tree(state["params"], self.layout.state["params"])
        )


def base_by_slices(training: dict) -> bool:
    """Whether a base's FP32 masters are converted slice by slice as they are placed: on a
    mesh that shards them (each process converts only its devices' slices)."""
    from ...training import data_parallel

    dp = data_parallel.DataParallel.from_training(training)
    return dp.devices > 1 and dp.shard_params


def frozen_base(arrays: dict, training: dict, lora, scan_layers: bool = False):
    """LoRA's frozen base as stored: on the device (``scan_layers``: its layers stacked there
    once, :func:`minifield.hf.stored_base.stacked`, so the step does not stack a copy every
    step), or, for a data-parallel run, the host's arrays, which ``lay_out_mesh`` places on
    the mesh slice by slice (never whole on one device first)."""
    from ...hf import stored_base
    from ...training.data_parallel import DataParallel

    if lora.quantization is not None:  # one device (validation): codes and scales
        from ...hf import quantized_base

        base = quantized_base.on_device(arrays, lora)
    elif DataParallel.from_training(training).devices == 1:
        base = stored_base.on_device(arrays, lora.base_dtype)
    else:
        return stored_base.on_host(arrays, lora.base_dtype)
    return stored_base.stacked(base) if scan_layers else base


def base_on_mesh(dp, mesh, base) -> tuple:
    """LoRA's frozen base placed on the mesh by the state's rule (replicated, or split under
    ``shard_params``), and its shardings."""
    from ...training import data_parallel

    shardings = dp.state_shardings(mesh, {"params": base})["params"]
    return data_parallel.place_tree(base, shardings), shardings
