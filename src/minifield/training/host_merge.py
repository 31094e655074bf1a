"""A LoRA run's merged weights made on the host, one tensor at a time, as the export writes
them: ``W + (alpha / rank) * A @ B`` in FP32, never the whole base on the device.

The merge the device ran before (:func:`.lora.merged` under ``jax.jit``) held the base and the
merged FP32 model there at once: 48 GB for an 8B base, on a 16 GB chip. Here the writer
(:func:`minifield.hf.checkpoint.write`) asks for each tensor as it fills a shard, and
:meth:`HostMerge.value` makes it from the prepared (memory-mapped) base tensor and the
adapters: the host holds the FP32 values of the tensors in hand, never the model, and each
base tensor's mapped pages are dropped once it is read (:func:`.stored_base.release`). A quantized base is merged the same way, into the unquantized base (what PEFT gives for
base + adapter, as QLoRA merges).

The values are :func:`.lora.merged`'s on XLA:CPU, bit for bit (``tests/test_host_merge.py``):
the base widened as the step sees it (stored dtype → ``base_dtype`` → FP32, in NumPy; each
conversion exact or rounded to nearest even, as XLA's), then ``W + scale * (A @ B)`` by the
same XLA operation on JAX's CPU device. Not NumPy's: XLA:CPU fuses the multiply and the add
into one rounding (two roundings differ in about one value in a thousand at a scale such as
8 / 3), and its matrix products (XNNPACK's kernels) sum the rank's terms in an order of their
own for some shapes (a 32 × 4 by 4 × 16 product differs from OpenBLAS's in a few values). A
process whose JAX has no CPU backend (``JAX_PLATFORMS`` without ``cpu``) runs the same
operation on its default device, still one tensor at a time.
"""

from __future__ import annotations

import numpy as np


def _merge_op(scale: float, out_in: bool):
    """``(w, a, b) -> w + scale * a @ b`` (FP32, jitted) and the device it runs on; ``out_in``:
    ``w`` held as stored, ``[out, in]``, and ``a @ b`` transposed to it. The product is the
    ``[in, out]`` expression's own (kept as computed by an optimization barrier: left free,
    XLA makes the transposed product with its operands swapped, another kernel whose sums
    differ in the last bit at some shapes), the multiply and add are its too: the values are
    those of the ``[in, out]`` expression bit for bit (``tests/test_host_merge.py``), and ``w``
    is never copied into the other layout."""
    import jax
    import jax.numpy as jnp

    try:
        device = jax.devices("cpu")[0]
    except RuntimeError:  # no CPU backend in this process: its default device
        device = jax.devices()[0]

    @jax.jit
    def op(w, a, b):  # lora.merged's per-target expression
        product = jnp.matmul(a, b, precision=jax.lax.Precision.HIGHEST)
        if out_in:
            return w + scale * jax.lax.optimization_barrier(product).T
        return w + scale * product

    return op, device


class HostMerge:
    """The merged parameters of a LoRA run, made tensor by tensor on the host.

    ``arrays``: the prepared examples' arrays (the base as stored, memory-mapped);
    ``adapters``: the state's per-layer adapters (on a device or the host: a copy of each is
    read here, they are small); ``settings``: the run's
    :class:`~minifield.training.lora.LoraSettings`. :attr:`params` is the parameter tree the
    writer walks (each leaf the parameter's path) and :meth:`value` its ``fetch``."""

    def __init__(self, arrays: dict, adapters: dict, settings):
        from ..hf import stored_base
        from ..state.arrays import to_host
        from .lora import adapted_leaves

        base = stored_base.on_host(arrays, settings.base_dtype)
        self.stored = dict(stored_base.flatten(base.params))
        self.out_in, self.settings = base.out_in, settings
        self.pairs: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        for layer, parents, leaf, pair in adapted_leaves(adapters):
            a, b = to_host(pair["a"]), to_host(pair["b"])  # the experts': stacked, as theirs
            self.pairs["/".join(("blocks", layer, *parents, leaf))] = (a, b)
        # the jitted merges, made before the writer's threads ask for values side by side
        self._ops = {out_in: _merge_op(settings.scale, out_in) for out_in in (False, True)}
        self.params: dict = {}
        for path in self.stored:
            *parents, leaf = path.split("/")
            node = self.params
            for part in parents:
                node = node.setdefault(part, {})
            node[leaf] = _Tensor(path)

    def value(self, tensor: _Tensor) -> np.ndarray:
        """The merged FP32 ``[in, out]`` matrix of a leaf of :attr:`params` (an expert's: its
        own ``W[j] + scale * A[j] @ B[j]``; see the module)."""
        import ml_dtypes

        from ..hf import stored_base

        path, j = tensor.path, tensor.expert
        stored = self.stored[path] if j is None else self.stored[path][j]
        held = ml_dtypes.bfloat16 if self.settings.base_dtype == "bfloat16" else np.float32
        w = np.asarray(stored).astype(held, copy=False).astype(np.float32)  # as stored
        stored_base.release(stored)  # read: its mapped pages go (the base is gigabytes)
        out_in = path in self.out_in
        if path in self.pairs:
            import jax

            op, device = self._ops[out_in]
            a, b = self.pairs[path] if j is None else (x[j] for x in self.pairs[path])
            w = np.asarray(
                op(*(jax.device_put(np.asarray(x, np.float32), device) for x in (w, a, b)))
            )
        return w.T if out_in else w  # a view: the writer's transpose back to HF's is none


class _Tensor:
    """A leaf of :attr:`HostMerge.params`: a stored parameter's path, and (the experts held
    stacked) the expert the writer's ``leaf[j]`` asks for."""

    def __init__(self, path: str, expert: int | None = None):
        self.path, self.expert = path, expert

    def __getitem__(self, j: int) -> _Tensor:
        return _Tensor(self.path, j)
