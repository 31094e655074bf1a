"""A frozen table held in the host's memory, its rows gathered there.

A QLoRA run of an 8B model on one 16 GB chip holds its frozen token embedding (1.05 GB in
BF16 at Llama-3.1-8B's vocabulary) in the host's pinned memory instead of the device's
(docs/quantized-base.md, "The embedding on the host"): the step gathers the batch's rows on
the host (``compute_on("device_host")``) and only those rows (16.8 MB for 2048 tokens) cross
to the device. A gather is exact, so the rows, and every bit after them, are those of the
table held on the device.
"""

from __future__ import annotations

import inspect

import jax
from jax.experimental.compute_on import compute_on


def _rows(table, ids):
    # no index clamping: its comparisons would be device constants, which a computation on
    # the host refuses; the ids are a tokenizer's, within the table
    return table.at[ids].get(mode="promise_in_bounds")


# computed on the host: JAX 0.10 (the lock's for Python 3.11, the chip's) names where as a
# context; later JAX (0.12, the lock's for 3.12) takes the function and its output's memory
if "out_memory_spaces" in inspect.signature(compute_on).parameters:
    _gather = jax.jit(
        compute_on(_rows, compute_type="device_host", out_memory_spaces=jax.memory.Space.Host)
    )
else:
    _gather = compute_on("device_host")(jax.jit(_rows))


@jax.tree_util.register_pytree_node_class
class HostTable:
    """``table`` (an array placed in ``pinned_host`` memory), seen in ``dtype``."""

    def __init__(self, table, dtype):
        self.table, self.dtype = table, dtype

    def tree_flatten(self):
        return (self.table,), self.dtype

    @classmethod
    def tree_unflatten(cls, dtype, children):
        return cls(children[0], dtype)

    def __getitem__(self, ids):
        """``table[ids]`` on the device, in ``dtype``: gathered on the host (indexed as the
        table on the device is, so the model reads either alike)."""
        host, device = jax.memory.Space.Host, jax.memory.Space.Device
        gathered = _gather(jax.device_put(self.table, host), jax.device_put(ids, host))
        return jax.device_put(gathered, device).astype(self.dtype)
