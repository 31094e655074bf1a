"""Grouped matrix products: rows sorted by group, each group's rows times its own matrix (the
experts of :mod:`minifield.models.moe`), what ``jax.lax.ragged_dot`` computes, done tile by tile.

This is the product on CPU and GPU; a recipe naming the TPU takes ``ragged_dot`` itself
(:mod:`.tpu_grouped`, chosen by ``execution.grouped_kernel``). Why not ``ragged_dot`` here:
where the backend has no ragged-dot instruction (CPU, in the pinned JAX 0.10.2), JAX lowers
it densely, every row times every group's matrix under a mask
(a ``[G, M, K]`` operand, and the same in its transpose), so ``G`` groups cost ``G`` times the
grouped work: with top-2 routing, twice the work of running every expert on every token
(``benchmarks/moe_update.py``). Here each group's rows go through its own matrix in tiles of
:data:`TILE` rows, and its last rows in tiles of :data:`TAIL` rows, so fewer than ``TAIL``
rows per group are multiplied and then dropped; one loop over the tiles of every group, whose
trip count is the number of tiles, reads the group's matrix by a dynamic index (so the
program's size does not grow with the number of groups). The backward pass is written out (a
custom VJP: JAX cannot differentiate a loop whose trip count depends on the data), one loop
over the same tiles: the rows' gradient against the transposed matrices, each group's matrix
gradient the sum over its tiles of ``x_tile^T @ dy_tile`` (rows of other groups masked to zero).

Precision as :func:`.primitives.einsum` (FP32 products at ``HIGHEST``): with BF16 compute the operands are rounded to BF16 and
every product, forward and backward, is BF16 x BF16 accumulated in FP32; the gradients leave
in the operands' own dtypes (FP32 master matrices: FP32, without a BF16 rounding). Rows past
``sum(sizes)`` give zeros, as ``ragged_dot``'s.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from .. import execution
from . import tpu_grouped
from .primitives import F32, full_precision

#: rows per tile (the matrix products' height), and per tile of a group's last rows
TILE, TAIL = 64, 16

_DS, _DUS = jax.lax.dynamic_slice_in_dim, jax.lax.dynamic_update_slice_in_dim


def matmul(cfg, x_MxK, w_GxKxN, sizes_G):
    """``[M, N]`` FP32: row ``m`` of group ``g`` (the rows sorted by group, ``sizes_G[g]`` of
    them) times ``w_GxKxN[g]``, in ``cfg.compute_dtype``; rows past ``sum(sizes_G)`` are 0.
    The recipe's backend picks the product (``execution.grouped_kernel``): the tiles here, or
    ``jax.lax.ragged_dot`` on a TPU (:mod:`.tpu_grouped`)."""
    sizes_G = sizes_G.astype(jnp.int32)
    kernel = execution.grouped_kernel(cfg.execution.backend)
    if kernel == "tiles":
        return tiled(cfg.compute_dtype, x_MxK, w_GxKxN, sizes_G)
    return tpu_grouped.matmul(cfg.compute_dtype, x_MxK, w_GxKxN, sizes_G, kernel)


def tiled(compute_dtype: str, x_MxK, w_GxKxN, sizes_G):
    """:func:`matmul` tile by tile (``sizes_G`` int32), whatever the backend."""
    return _matmul(compute_dtype, x_MxK, w_GxKxN, sizes_G)


def _each(counts_G, fn, carry):
    """``carry = fn(g, j, carry)`` for ``j < counts_G[g]`` of every group ``g`` in turn, as one
    loop over the total count."""
    cum_G = jnp.cumsum(counts_G)

    def body(i, carry):
        g = jnp.sum(cum_G <= i, dtype=jnp.int32)
        return fn(g, i - (cum_G[g] - counts_G[g]), carry)

    return jax.lax.fori_loop(0, cum_G[-1], body, carry)


def _tiles(sizes_G, fn, carry):
    """``carry = fn(g, start, rows, keep, carry)`` over every tile of every group: the
    ``TILE``-row tiles (``keep`` None: all the group's), then the ``TAIL``-row tiles of the
    rest (``keep [rows]``: which rows are the group's)."""
    ends_G = jnp.cumsum(sizes_G)
    starts_G = ends_G - sizes_G
    full_G = sizes_G // TILE
    tail_G = (sizes_G - full_G * TILE + TAIL - 1) // TAIL
    carry = _each(full_G, lambda g, j, c: fn(g, starts_G[g] + j * TILE, TILE, None, c), carry)

    def tail(g, j, c):
        start = starts_G[g] + full_G[g] * TILE + j * TAIL
        return fn(g, start, TAIL, start + jnp.arange(TAIL) < ends_G[g], c)

    return _each(tail_G, tail, carry)


def _rows(x_PxK, w_GxKxN, sizes_G):
    """Every group's rows times its matrix, ``[P, N]`` FP32; rows no group holds stay 0."""

    def fn(g, start, rows, keep, y_PxN):
        w_KxN = jax.lax.dynamic_index_in_dim(w_GxKxN, g, keepdims=False)
        y_RxN = jnp.dot(
            _DS(x_PxK, start, rows),
            w_KxN,
            precision=full_precision(x_PxK.dtype),
            preferred_element_type=F32,
        )
        if keep is not None:  # rows of the next group keep what their own tile wrote
            y_RxN = jnp.where(keep[:, None], y_RxN, _DS(y_PxN, start, rows))
        return _DUS(y_PxN, y_RxN, start, 0)

    return _tiles(sizes_G, fn, jnp.zeros((x_PxK.shape[0], w_GxKxN.shape[2]), F32))


def _grads(x_PxK, w_GxKxN, dy_PxN, sizes_G):
    """``(dx [P, K], dw [G, K, N])`` FP32, in one loop over the tiles: each row's ``dy @ w^T``
    of its group's matrix, and each group's sum over its tiles of ``x^T @ dy`` (rows of other
    groups masked to zero)."""
    precision = full_precision(x_PxK.dtype)

    def fn(g, start, rows, keep, carry):
        dx_PxK, dw_GxKxN = carry
        w_KxN = jax.lax.dynamic_index_in_dim(w_GxKxN, g, keepdims=False)
        x_RxK, dy_RxN = _DS(x_PxK, start, rows), _DS(dy_PxN, start, rows)
        dx_RxK = jax.lax.dot_general(
            dy_RxN, w_KxN, (((1,), (1,)), ((), ())), precision, preferred_element_type=F32
        )
        if keep is not None:
            dx_RxK = jnp.where(keep[:, None], dx_RxK, _DS(dx_PxK, start, rows))
            x_RxK = jnp.where(keep[:, None], x_RxK, jnp.zeros((), x_RxK.dtype))
        dw_KxN = jax.lax.dot_general(
            x_RxK, dy_RxN, (((0,), (0,)), ((), ())), precision, preferred_element_type=F32
        )
        dw_1xKxN = _DS(dw_GxKxN, g, 1) + dw_KxN[None]
        return _DUS(dx_PxK, dx_RxK, start, 0), _DUS(dw_GxKxN, dw_1xKxN, g, 0)

    zeros = (jnp.zeros(x_PxK.shape, F32), jnp.zeros(w_GxKxN.shape, F32))
    return _tiles(sizes_G, fn, zeros)


def _padded(a_MxK, dtype):
    """``a`` in ``dtype`` with ``TILE`` zero rows after it, so a tile never reads past the end
    (a dynamic slice would be moved back, onto other rows)."""
    return jnp.pad(a_MxK.astype(dtype), ((0, TILE), (0, 0)))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _matmul(compute_dtype: str, x_MxK, w_GxKxN, sizes_G):
    return _matmul_fwd(compute_dtype, x_MxK, w_GxKxN, sizes_G)[0]


def _matmul_fwd(compute_dtype, x_MxK, w_GxKxN, sizes_G):
    x_PxK = _padded(x_MxK, compute_dtype)
    w_c = w_GxKxN.astype(compute_dtype)
    y_MxN = _rows(x_PxK, w_c, sizes_G)[: x_MxK.shape[0]]
    # the operands' dtypes ride along as zero-size arrays (residuals must be arrays)
    protos = (jnp.zeros((0,), x_MxK.dtype), jnp.zeros((0,), w_GxKxN.dtype))
    return y_MxN, (x_PxK, w_c, sizes_G, *protos)


def _matmul_bwd(compute_dtype, residuals, dy_MxN):
    x_PxK, w_c, sizes_G, x_proto, w_proto = residuals
    dy_PxN = _padded(dy_MxN, compute_dtype)
    dx_PxK, dw_GxKxN = _grads(x_PxK, w_c, dy_PxN, sizes_G)
    dx_MxK = dx_PxK[: dy_MxN.shape[0]]
    return dx_MxK.astype(x_proto.dtype), dw_GxKxN.astype(w_proto.dtype), None


_matmul.defvjp(_matmul_fwd, _matmul_bwd)
