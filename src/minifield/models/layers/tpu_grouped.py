"""The experts' grouped product through ``jax.lax.ragged_dot``: what :func:`.grouped.matmul`
computes for a recipe with ``runtime.backend: tpu`` (``execution.grouped_kernel``).

On a TPU JAX lowers ``ragged_dot`` to XLA's ragged-dot instruction, the chip's grouped matrix
product, so each group's rows meet only its own matrix without the tiles and the loop over
them of :mod:`.grouped` (which the CPU keeps: there the pinned JAX lowers ``ragged_dot``
densely, every row times every group's matrix under a mask). It runs on CPU too, densely,
which is how the suite checks it against the tiled product and a float64 loop.

The same contract as the tiled product: the operands rounded to the compute dtype, every
product accumulated in FP32, FP32 products at ``Precision.HIGHEST``
(:func:`.primitives.full_precision`), forward and backward; rows past ``sum(sizes)`` give
zeros (and zero gradients); the gradients leave in the operands' own dtypes. The backward
pass is written out, as the tiled one's, so its products are BF16 x BF16 -> FP32 with BF16
compute (autodiff of ``ragged_dot`` would multiply by the FP32 output gradient): the rows'
gradient ``dy @ w[g]^T`` is a ``ragged_dot`` against the transposed matrices, and each
group's matrix gradient ``x_g^T @ dy_g`` a ``ragged_dot_general`` ragged in the contracted
rows (the form JAX's own transpose of ``ragged_dot`` takes, the chip's transposed grouped
product).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from .primitives import F32, full_precision

#: ``x [M, K]`` and ``dy [M, N]`` contracted over their rows, ragged there: ``[G, K, N]``
_GROUP_GRADIENT = jax.lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(((0,), (0,)), ((), ())),
    lhs_ragged_dimensions=[0],
    rhs_group_dimensions=[],
)


def matmul(compute_dtype: str, x_MxK, w_GxKxN, sizes_G):
    """``[M, N]`` FP32: row ``m`` of group ``g`` (rows sorted by group, ``sizes_G[g]`` of
    them, int32) times ``w_GxKxN[g]``, in ``compute_dtype``; rows past ``sum(sizes_G)``: 0."""
    return _matmul(compute_dtype, x_MxK, w_GxKxN, sizes_G)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _matmul(compute_dtype: str, x_MxK, w_GxKxN, sizes_G):
    return _matmul_fwd(compute_dtype, x_MxK, w_GxKxN, sizes_G)[0]


def _matmul_fwd(compute_dtype, x_MxK, w_GxKxN, sizes_G):
    x_c, w_c = x_MxK.astype(compute_dtype), w_GxKxN.astype(compute_dtype)
    y_MxN = jax.lax.ragged_dot(
        x_c, w_c, sizes_G, precision=full_precision(x_c.dtype), preferred_element_type=F32
    )
    # the operands' dtypes ride along as zero-size arrays (residuals must be arrays)
    protos = (jnp.zeros((0,), x_MxK.dtype), jnp.zeros((0,), w_GxKxN.dtype))
    return y_MxN, (x_c, w_c, sizes_G, *protos)


def _matmul_bwd(compute_dtype, residuals, dy_MxN):
    x_c, w_c, sizes_G, x_proto, w_proto = residuals
    dy_c = dy_MxN.astype(compute_dtype)
    precision = full_precision(x_c.dtype)
    dx_MxK = jax.lax.ragged_dot(
        dy_c, jnp.swapaxes(w_c, 1, 2), sizes_G, precision=precision, preferred_element_type=F32
    )
    dw_GxKxN = jax.lax.ragged_dot_general(
        x_c, dy_c, sizes_G, _GROUP_GRADIENT, precision=precision, preferred_element_type=F32
    )
    return dx_MxK.astype(x_proto.dtype), dw_GxKxN.astype(w_proto.dtype), None


_matmul.defvjp(_matmul_fwd, _matmul_bwd)
