"""Data parallelism on one host: a 1-D device mesh and where each array of the state lives.

A recipe asks for ``training.data_parallel: {devices: N, shard_params: false}``. The
update is then one program compiled for a ``jax.sharding.Mesh`` of the first ``N``
visible devices with a single axis ``"data"``:

- the batch is split along its first (row) axis, ``B / N`` rows per device;
- parameters and optimizer state are replicated on every device, or, with
  ``shard_params: true``, each array is split along its first axis whose size ``N``
  divides (arrays with no such axis, and scalars, stay replicated; stacked layers of
  ``model.scan_layers`` are split within each layer, never along the layer axis);
- RNG key data, the step and the data cursor are replicated.

XLA inserts the collectives (the all-reduce of the gradients, or reduce-scatter /
all-gather when parameters are sharded). The loss is a token-weighted mean over the
whole global batch either way, so the *mathematics* of an update does not depend on
``N``; its floating-point *bits* do (partial sums are formed per device and then
combined, a different summation order). That is why the device count is part of the
computation (it lives under ``training``, inside the computation digest).

The mesh is built lazily, only when an update is compiled or a state placed, so a
process that merely evaluates checkpoints or exports weights needs no more than one
device.

No array of the state passes through one device on its way to the mesh: a fresh state is
computed by one program compiled with the state's shardings as output shardings
(:func:`sharded_program`: each device computes only its own slices, the random parameters
included), and host arrays (a restored checkpoint, a base model's weights) are placed
leaf by leaf with :func:`place` (each device receives only its slice; in a mesh over
several processes each process creates only its own devices' shards).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from ..hf.stored_base import FP32Slices
from ..models import moe
from ..models.layers import layer_stack

AXIS = "data"


class DeviceCountError(RuntimeError):
    """Fewer devices are visible than the recipe's data parallelism asks for."""


@dataclass(frozen=True)
class DataParallel:
    devices: int = 1
    shard_params: bool = False

    @classmethod
    def from_training(cls, training: dict) -> DataParallel:
        section = training.get("data_parallel") or {}
        return cls(int(section.get("devices", 1)), bool(section.get("shard_params", False)))

    def mesh(self) -> Mesh:
        """The first ``devices`` visible devices as a 1-D mesh named ``data``."""
        visible = jax.devices()
        if len(visible) < self.devices:
            raise DeviceCountError(missing_devices_message(self.devices, len(visible)))
        return Mesh(visible[: self.devices], (AXIS,))

    def batch_sharding(self, mesh: Mesh) -> NamedSharding:
        """Rows (the leading axis) split over the mesh."""
        return NamedSharding(mesh, PartitionSpec(AXIS))

    def replicated(self, mesh: Mesh) -> NamedSharding:
        return NamedSharding(mesh, PartitionSpec())

    def _leaf_spec(self, shape: tuple[int, ...], first_axis: int = 0) -> PartitionSpec:
        for axis in range(first_axis, len(shape)):
            if shape[axis] % self.devices == 0 and shape[axis] >= self.devices:
                return PartitionSpec(*([None] * axis), AXIS)
        return PartitionSpec()

    def state_shardings(self, mesh: Mesh, abstract_state: dict) -> dict:
        """A sharding per leaf of the complete state (same tree structure)."""
        replicated = self.replicated(mesh)

        def sharded(path, leaf):
            if not self.shard_params or self.devices == 1 or not leaf.shape:
                return replicated
            # Stacked layers (``model.scan_layers``) are split within each layer, never along
            # the layer axis: the scan takes one layer per iteration, and a layer held by one
            # device would have to be gathered whole before the loop. The experts' stacked
            # matrices likewise within each expert, as when they were held one by one.
            first_axis = int(layer_stack.is_stacked_leaf(path)) + int(moe.holds_experts(path))
            return NamedSharding(mesh, self._leaf_spec(tuple(leaf.shape), first_axis))

        out = {}
        for part, subtree in abstract_state.items():
            if part in ("params", "opt_state"):
                out[part] = jax.tree_util.tree_map_with_path(sharded, subtree)
            else:
                out[part] = jax.tree_util.tree_map(lambda _: replicated, subtree)
        return out

    def lay_out(self, abstract_state: dict) -> Layout:
        """The mesh, and the shardings of a state shaped like ``abstract_state`` and of a
        batch on it."""
        mesh = self.mesh()
        return Layout(
            self, mesh, self.state_shardings(mesh, abstract_state), self.batch_sharding(mesh)
        )


@dataclass(frozen=True)
class Layout:
    """Where a data-parallel update runs: the mesh and the shardings of the state and batch."""

    data_parallel: DataParallel
    mesh: Mesh
    state: dict
    batch: NamedSharding

    def placement(self) -> dict:
        """What the ``compiled`` event reports of it."""
        dp = self.data_parallel
        return {
            "devices": dp.devices,
            "shard_params": dp.shard_params,
            "mesh": {AXIS: dp.devices},
            **describe(self.state),
        }


def missing_devices_message(wanted: int, visible: int) -> str:
    return (
        f"recipe training.data_parallel.devices={wanted} but only {visible} device(s) are "
        f"visible ({jax.default_backend()} backend); run where {wanted} devices are visible "
        f"(on CPU: XLA_FLAGS=--xla_force_host_platform_device_count={wanted}), or change "
        "training.data_parallel.devices (a different device count is a different computation)"
    )


def describe(shardings: dict) -> dict:
    """Counts of sharded and replicated state arrays (for the ``compiled`` event)."""
    leaves = jax.tree_util.tree_leaves(shardings)
    sharded = sum(1 for s in leaves if not s.is_fully_replicated)
    return {"sharded_arrays": sharded, "replicated_arrays": len(leaves) - sharded}


def place(value, sharding):
    """``value`` with ``sharding``, no device ever holding more than its own slice.

    A host array goes to each (addressable) device as that device's slice
    (``jax.make_array_from_callback``), not as a whole array first put on one device; a
    device array is resharded (nothing moves when it already has ``sharding``).
    """
    if isinstance(value, jax.Array):
        return jax.device_put(value, sharding)
    # a base tensor converted slice by slice (stored_base.FP32Slices) stays so: each slice
    # is converted as its device asks for it
    host = value if isinstance(value, FP32Slices) else np.asarray(value)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def place_tree(tree, shardings):
    """:func:`place` for every leaf of ``tree`` (``shardings`` has the same structure)."""
    return jax.tree_util.tree_map(place, tree, shardings)


def sharded_program(make: Callable, shardings):
    """``make`` jit-compiled with ``shardings`` as its output shardings.

    Each device computes only the slices it holds (random parameters too: the threefry
    generator is partitionable, so a slice's values are those of the whole array), so the
    state is never whole on one device. The values are the ones ``make`` gives op by op
    (the model's initialisation keeps XLA from refolding its constants, see
    ``model.scaled_normal``), so the state hash does not depend on the placement.
    """
    return jax.jit(make, out_shardings=shardings)
