"""The step-0 state of a packed-sft program: where training starts.

At random (``sft_step.init_train_state``), from given FP32 weights (a base model's, or a
stage-1 export's), or, for LoRA, fresh adapters over a frozen base (``lora.init_state``).
Created op by op on the default device, or, on a data-parallel mesh, by one compiled program
in the update's shardings, so the state is never whole on one device; both give the same
bits (and so the same state hash).
"""

from __future__ import annotations

import numpy as np

from ..hf.stored_base import FP32Slices
from . import lora


def state_from_params(params: dict, optimizer, seed: int, stacked: bool = False) -> dict:
    """The step-0 state starting from given FP32 parameters (a base model's): the same layout
    as ``sft_step.init_train_state``, whose random initialisation it replaces (``stacked``:
    the blocks stacked, as a scanned run holds them, see ``layer_stack``)."""
    import jax
    import jax.numpy as jnp

    from ..models.layers import layer_stack

    def on_device(value):
        if isinstance(value, FP32Slices):  # on one device: converted whole
            value = np.asarray(value)
        if isinstance(value, np.ndarray) and value.dtype == np.float32:
            # adopted without a copy where JAX can (an aligned host array): JAX never writes
            # into it — a step that donates the state allocates its own outputs for it — so
            # the host weights stay as they are, and the start writes no second copy
            return jax.device_put(value)
        return jnp.array(value, dtype=jnp.float32)

    params = jax.tree_util.tree_map(on_device, params)
    if stacked:
        params = layer_stack.stack_layers(params)
    return {
        "params": params,
        "opt_state": optimizer.init(params),
        "rng": jax.random.key_data(jax.random.key(seed)),
        "step": jnp.zeros((), jnp.int32),
        "cursor": jnp.zeros((), jnp.int32),
    }


class InitialState:
    """Where a program starts. ``base_params``: host FP32 weights to start from (None: at
    random); ``lora``: ``(settings, base identity)`` of a LoRA run, whose state is the
    adapters'."""

    def __init__(self, cfg, optimizer, seed: int, base_params=None, lora_run=None):
        self.cfg, self.optimizer, self.seed = cfg, optimizer, seed
        self.base_params, self.lora_run = base_params, lora_run
        self.compiled_on_mesh = None  # the initialisation compiled for the mesh (once)

    def random(self) -> dict:
        from .train_step import init_train_state

        return init_train_state(self.cfg, self.optimizer, self.seed)

    def on_one_device(self) -> dict:
        """The step-0 state on the default device, op by op (also its shapes for compiling)."""
        from ..models.layers import layer_stack

        if self.lora_run is not None:
            settings, identity = self.lora_run
            return lora.init_state(self.cfg, settings, self.optimizer, self.seed, identity)
        if self.base_params is None:
            return self.random()
        stacked = layer_stack.holds_stacked(self.cfg)
        return state_from_params(self.base_params, self.optimizer, self.seed, stacked)

    def abstract(self) -> dict:
        """The step-0 state's shapes and dtypes (what the update is compiled for), from the
        base weights' shapes alone where there are some (none converted for it)."""
        import jax

        from ..models.layers import layer_stack

        if self.lora_run is not None or self.base_params is None:
            return jax.eval_shape(self.on_one_device)
        shapes = jax.tree_util.tree_map(
            lambda v: jax.ShapeDtypeStruct(tuple(v.shape), np.float32), self.base_params
        )
        stacked = layer_stack.holds_stacked(self.cfg)
        return jax.eval_shape(
            lambda params: state_from_params(params, self.optimizer, self.seed, stacked), shapes
        )

    def on_mesh(self, shardings: dict) -> dict:
        """The step-0 state created in ``shardings`` (never whole on one device): random
        parameters computed slice by slice on the devices that hold them, or the host weights
        placed slice by slice; the same bits as :meth:`on_one_device`. Compiled once (a
        resume builds a template state first)."""
        from ..models.layers import layer_stack
        from . import data_parallel

        if self.lora_run is not None:  # fresh adapters, drawn slice by slice
            make, args = self.on_one_device, ()
        elif self.base_params is None:
            make, args = self.random, ()
        else:
            host = self.base_params
            if layer_stack.holds_stacked(self.cfg):  # stacked on the host, placed slice by slice
                host = layer_stack.stack_layers(host, stack=np.stack)
            args = (data_parallel.place_tree(host, shardings["params"]),)

            def make(params):
                return state_from_params(params, self.optimizer, self.seed)

        if self.compiled_on_mesh is None:
            self.compiled_on_mesh = (
                data_parallel.sharded_program(make, shardings).lower(*args).compile()
            )
        return self.compiled_on_mesh(*args)
