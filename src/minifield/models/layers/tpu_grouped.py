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
gradient ``dy @ w[g]^T`` is a ``ragged_dot_general`` contracting the matrices' output axis (no
transposed copy of them), and each
group's matrix gradient ``x_g^T @ dy_g`` a ``ragged_dot_general`` ragged in the contracted
rows (both the forms JAX's own transpose of ``ragged_dot`` takes, the chip's transposed grouped
products).

``kernel="gmm"``: the same products through megablox's Pallas kernels
(``jax.experimental.pallas.ops.tpu.megablox``: ``gmm``, and ``tgmm`` for the matrices'
gradient), the other way to the chip's grouped product; which is faster is the chip's to
measure (``benchmarks/moe_chip.py``), and ``execution.GROUPED_KERNELS`` is where the choice is
made. BF16 compute only: its products ask for no precision, so FP32 would not be full FP32.
Its rows are tiled by :data:`GMM_TILING`'s first size (padded to it here; padding and rows past
the groups give zeros), and it runs in Pallas's interpreter on CPU (tests).

``kernel="ragged_tgmm"``: ``ragged_dot`` for the rows (forward and their gradient), ``tgmm``
for the matrices' gradient alone. The chip's compiler (libtpu 0.0.42.1) lowers a
``ragged_dot_general`` ragged in its contracted rows to a product over every group's rows
under a mask, all groups' rows for each group: at 16 experts 16 times the matrices'
gradient's FLOPs (docs/tpu.md, "Where the experts' time goes"); ``tgmm`` runs only each
group's rows. BF16 compute only, as ``gmm``; which is faster is the chip's to measure.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from .primitives import F32, full_precision

#: the grouped products this module has (``kernel``)
KERNELS = ("ragged_dot", "gmm", "ragged_tgmm")
#: the kernels with a megablox (Pallas) part, which asks its products for no precision
_MEGABLOX = ("gmm", "ragged_tgmm")
#: megablox's (rows, contracted, output) tile sizes: its defaults
GMM_TILING = (128, 128, 128)

#: ``dy [M, N]`` row by row against its group's ``w [G, K, N]``, contracted over ``N``:
#: ``[M, K]``, the transposed product without a transposed copy of ``w`` (the form JAX's own
#: transpose of ``ragged_dot`` takes; a ``swapaxes`` here wrote every expert's matrix again,
#: ``benchmarks/moe_census.py``)
_ROW_GRADIENT = jax.lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(((1,), (2,)), ((), ())),
    lhs_ragged_dimensions=[0],
    rhs_group_dimensions=[0],
)
#: ``x [M, K]`` and ``dy [M, N]`` contracted over their rows, ragged there: ``[G, K, N]``
_GROUP_GRADIENT = jax.lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(((0,), (0,)), ((), ())),
    lhs_ragged_dimensions=[0],
    rhs_group_dimensions=[],
)


def matmul(compute_dtype: str, x_MxK, w_GxKxN, sizes_G, kernel: str = "ragged_dot"):
    """``[M, N]`` FP32: row ``m`` of group ``g`` (rows sorted by group, ``sizes_G[g]`` of
    them, int32) times ``w_GxKxN[g]``, in ``compute_dtype``; rows past ``sum(sizes_G)``: 0.
    ``kernel``: one of :data:`KERNELS`."""
    if kernel not in KERNELS:
        raise ValueError(f"grouped product: expected a kernel of {KERNELS}, got {kernel!r}")
    if kernel in _MEGABLOX and jnp.dtype(compute_dtype) == F32:
        raise ValueError(
            f"grouped product {kernel}: its products ask for no precision, so FP32 compute "
            "would not be full FP32 on a TPU; use ragged_dot for model.compute_dtype float32"
        )
    return _matmul(compute_dtype, kernel, x_MxK, w_GxKxN, sizes_G)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _matmul(compute_dtype: str, kernel: str, x_MxK, w_GxKxN, sizes_G):
    return _matmul_fwd(compute_dtype, kernel, x_MxK, w_GxKxN, sizes_G)[0]


def _matmul_fwd(compute_dtype, kernel, x_MxK, w_GxKxN, sizes_G):
    x_c, w_c = x_MxK.astype(compute_dtype), w_GxKxN.astype(compute_dtype)
    if kernel == "gmm":
        y_MxN = _gmm_rows(x_c, w_c, sizes_G, transpose=False)
    else:
        y_MxN = _past_the_groups_zero(
            jax.lax.ragged_dot(
                x_c, w_c, sizes_G, precision=full_precision(x_c.dtype), preferred_element_type=F32
            ),
            sizes_G,
        )
    # the operands' dtypes ride along as zero-size arrays (residuals must be arrays)
    protos = (jnp.zeros((0,), x_MxK.dtype), jnp.zeros((0,), w_GxKxN.dtype))
    return y_MxN, (x_c, w_c, sizes_G, *protos)


def _matmul_bwd(compute_dtype, kernel, residuals, dy_MxN):
    x_c, w_c, sizes_G, x_proto, w_proto = residuals
    dy_c = dy_MxN.astype(compute_dtype)
    if kernel == "gmm":
        dx_MxK = _gmm_rows(dy_c, w_c, sizes_G, transpose=True)
        dw_GxKxN = _gmm_groups(x_c, dy_c, sizes_G)
    else:
        precision = full_precision(x_c.dtype)
        dx_MxK = _past_the_groups_zero(
            jax.lax.ragged_dot_general(
                dy_c, w_c, sizes_G, _ROW_GRADIENT, precision, preferred_element_type=F32
            ),
            sizes_G,
        )
        if kernel == "ragged_tgmm":
            dw_GxKxN = _gmm_groups(x_c, dy_c, sizes_G)
        else:
            dw_GxKxN = jax.lax.ragged_dot_general(
                x_c, dy_c, sizes_G, _GROUP_GRADIENT, precision, preferred_element_type=F32
            )
            # an empty group's matrix gradient is 0 by definition, whatever the kernel wrote
            # (tgmm writes it: it visits every group, its sum started at 0)
            dw_GxKxN = jnp.where((sizes_G > 0)[:, None, None], dw_GxKxN, 0.0)
    return dx_MxK.astype(x_proto.dtype), dw_GxKxN.astype(w_proto.dtype), None


_matmul.defvjp(_matmul_fwd, _matmul_bwd)


def _tiled_rows(a_MxK):
    """``a`` with zero rows after it up to a whole number of gmm's row tiles."""
    tm = GMM_TILING[0]
    return jnp.pad(a_MxK, ((0, -a_MxK.shape[0] % tm), (0, 0)))


def _interpret() -> bool:
    """Native on a TPU, Pallas's interpreter elsewhere (tests on CPU)."""
    return jax.default_backend() != "tpu"


def _gmm_rows(a_MxK, w_c, sizes_G, transpose: bool):
    """``a`` row by row times its group's matrix (``transpose``: its transpose), ``[M, *]``
    FP32; rows past the groups, which the kernel never writes, are 0."""
    from jax.experimental.pallas.ops.tpu.megablox.gmm import gmm

    M = a_MxK.shape[0]
    out = gmm(
        _tiled_rows(a_MxK), w_c, sizes_G, F32, GMM_TILING,
        transpose_rhs=transpose, interpret=_interpret(),
    )[:M]  # fmt: skip
    return _past_the_groups_zero(out, sizes_G)


def _past_the_groups_zero(out_MxN, sizes_G):
    """``out`` with its rows past ``sum(sizes_G)`` set to 0, the contract: neither kernel is
    relied on to write them (on the chip the BF16 ``ragged_dot`` gave NaN where the tiles
    gave numbers: docs/tpu.md#tests-on-the-chip)."""
    M = out_MxN.shape[0]
    return jnp.where((jnp.arange(M) < jnp.sum(sizes_G))[:, None], out_MxN, 0.0)


def _gmm_groups(x_MxK, dy_MxN, sizes_G):
    """Each group's ``x_g^T @ dy_g``, ``[G, K, N]`` FP32 (megablox's ``tgmm``); an empty
    group's is 0: the kernel visits every group (``visit_empty_groups``), zeroing its sum when
    the group changes, so no pass over the whole ``[G, K, N]`` result needs to set them."""
    from jax.experimental.pallas.ops.tpu.megablox.gmm import tgmm

    x_PxK, dy_PxN = _tiled_rows(x_MxK), _tiled_rows(dy_MxN)
    return tgmm(
        x_PxK.T, dy_PxN, sizes_G, F32, GMM_TILING,
        num_actual_groups=sizes_G.shape[0], interpret=_interpret(),
    )  # fmt: skip
