"""``x @ dequantize(w)`` for a quantized frozen matrix (:mod:`minifield.models.quantize`) as one
Pallas TPU kernel that reads the codes and the FP32 scales and never writes the made-back
matrix to memory: what :func:`.primitives.linear` computes where ``execution.quantized_kernel``
names ``pallas`` (docs/quantized-base.md, "The product's kernel").

Each grid step loads a tile of the codes (int8 ``[in, out]``; NF4 ``[in / 2, out]``, two codes
a byte) and the scales' rows of that tile, makes the tile back as :func:`.quantize.dequantize`
does (the same FP32 values: NF4's table by the same tree of selects, int8 ``code × (1/127)``,
XLA's form of ``code / 127``; then ``× scale`` in FP32 and one rounding to the base's dtype),
rounds it to the compute dtype and multiplies it in VMEM, accumulating in FP32 in the output
tile. NF4 without an interleave in the kernel: ``x @ W = x[:, 0::2] @ W_high + x[:, 1::2] @
W_low``, the high nibbles being the even inputs (as bitsandbytes packs them), so each byte's
two nibbles are two ``[in / 2, out]`` tiles against the even and the odd columns of ``x``
(split outside the kernel, in XLA). Doubly quantized scales are decoded to FP32 outside it
(``quantize.scales_back``: 1/16 of the BF16 matrix at NF4's blocks of 64).

The backward pass is the rows' gradient only, ``dx = dy @ dequantize(w)^T``, by the same
kernel with the transposed product (the base is frozen: the codes and scales get none).
Batch axes are flattened into the rows.

Numbers: the made-back tile is :func:`.quantize.dequantize`'s bit for bit (the same FP32
operations in the same order); the products are BF16 × BF16, exact in FP32, summed in FP32 in
the kernel's order, not XLA's, so the result is within FP32 accumulation of the XLA path's
(the bound ``tests/test_quantized_kernel.py`` checks against float64). BF16 compute only: the
kernel's products ask for no precision, so FP32 operands would be the chip's one BF16 pass
(megablox's ``gmm`` and splash are refused for FP32 the same way).

Tiles (:data:`TILES`): rows ``M`` (padded to 16), output columns, and code rows (NF4: byte
rows, two inputs each). A tile's scale rows must be whole blocks of 8 rows (the TPU's
sublanes) or every row of the scales; a shape no tile fits is refused with one line naming
it. On CPU the kernel runs in Pallas's interpreter (tests).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from ..quantize import QuantizedWeight, nf4_values, scales_back

F32 = jnp.float32

#: the default (rows, output columns, code rows) of a tile: all of a 2048-token step's rows
#: at once, so each weight tile is made back once per product (its cost is the vector
#: unit's, ~20 operations a weight for NF4), and 512 × 512 weights a step
TILES = (2048, 512, 512)
#: the kernel's VMEM budget: at the default tiles about 20 MB (two buffers of the row and
#: output tiles, the made-back tile's FP32 temporaries); a v5e core has 128 MiB
VMEM_LIMIT_BYTES = 64 * 2**20
#: the most code rows a tile takes when no multiple of the lanes holds whole blocks (all of
#: them then): VMEM holds that many rows of every row and of the weight tile
WHOLE_ROWS = 2048
#: TPU layout: lanes (an array's last axis) and BF16 rows per packed vector register
LANES, ROWS = 128, 16
#: ``1 / 127`` as XLA computes ``code / 127`` (a product by the FP32 reciprocal)
_INV127 = np.float32(1.0) / np.float32(127.0)


@dataclass(frozen=True)
class Plan:
    """A product's static shape: ``rows`` code rows (int8 ``in``, NF4 ``in / 2``) by ``n``
    outputs, ``per_scale`` code rows per scale row, ``scale_rows`` of them, and its tiles."""

    scheme: str
    rows: int
    n: int
    per_scale: int
    scale_rows: int
    tm: int
    tn: int
    tk: int
    base_dtype: str
    compute_dtype: str

    @property
    def pieces(self) -> int:
        """Code tiles per byte tile: NF4's high and low nibbles, int8's one."""
        return 2 if self.scheme == "nf4" else 1

    @property
    def scale_tile(self) -> int:
        """Scale rows a tile reads: its blocks', or the one row of a per-channel matrix."""
        return 1 if self.scale_rows == 1 else self.tk // self.per_scale


def plan(w: QuantizedWeight, m: int, compute_dtype: str, tiles=None) -> Plan:
    """The product of ``m`` rows with ``w``; ``tiles`` (rows, columns, code rows): None is
    :data:`TILES`, each lowered to what divides the shape. Raises ValueError with one line."""
    if jnp.dtype(compute_dtype) == F32:
        raise ValueError(
            "the quantized product's kernel (pallas) computes in bfloat16 only: its products "
            "ask for no precision, so float32 would be the TPU's one BF16 pass; use the xla "
            "kernel for model.compute_dtype float32"
        )
    K, N = w.shape
    rows = K // 2 if w.scheme == "nf4" else K
    block = K if w.block is None else w.block
    per_scale = block // 2 if w.scheme == "nf4" else block
    scale_rows = K // block
    tm, tn, tk = TILES if tiles is None else tiles
    tm = _divisor(m, tm, ROWS) or m
    tn = _divisor(N, tn, LANES) or N
    fits = [t for t in range(tk - tk % LANES, 0, -LANES) if rows % t == 0]
    fits += [rows] if rows <= WHOLE_ROWS else []
    if tiles is not None:
        fits = [tk]
    for tk in fits:
        if rows % tk == 0 and (
            scale_rows == 1 or (tk % per_scale == 0 and ((tk // per_scale) % 8 == 0 or tk == rows))
        ):
            return Plan(w.scheme, rows, N, per_scale, scale_rows, tm, tn, tk, w.dtype,
                        str(jnp.dtype(compute_dtype)))  # fmt: skip
    raise ValueError(
        f"the quantized product's kernel (pallas) has no tile for a {w.scheme} matrix "
        f"{K} x {N} in blocks of {block}: a tile's rows must divide {rows} and hold whole "
        f"blocks, 8 of them or all (at most {WHOLE_ROWS}); use the xla kernel for this "
        "quantization_block"
    )


def _divisor(size: int, most: int, step: int) -> int | None:
    """The largest multiple of ``step`` at most ``most`` that divides ``size`` (None: none)."""
    return next((t for t in range(most - most % step, 0, -step) if size % t == 0), None)


def matmul(compute_dtype: str, x_BxTxK, w: QuantizedWeight, tiles=None):
    """``x @ dequantize(w)`` as FP32 ``[..., out]``, both operands in ``compute_dtype`` (BF16);
    ``tiles``: see :func:`plan`. Differentiable in ``x`` only (the base is frozen)."""
    K, N = w.shape
    lead = x_BxTxK.shape[:-1]
    x_MxK = x_BxTxK.reshape(-1, K)
    M = x_MxK.shape[0]
    Mp = M + (-M) % ROWS
    the_plan = plan(w, Mp, compute_dtype, tiles)
    if Mp != M:  # whole BF16 rows per register: zero rows, sliced off again
        x_MxK = jnp.pad(x_MxK, ((0, Mp - M), (0, 0)))
    codes = w.codes
    if w.scheme == "nf4":  # the kernel takes signed bytes; a byte's bits are unchanged
        codes = jax.lax.bitcast_convert_type(codes, jnp.int8)
    y_MxN = _product(the_plan, x_MxK, codes, scales_back(w).astype(F32))
    return y_MxN[:M].reshape(*lead, N)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _product(the_plan: Plan, x_MxK, codes, scales):
    return _product_fwd(the_plan, x_MxK, codes, scales)[0]


def _product_fwd(the_plan, x_MxK, codes, scales):
    x_c = x_MxK.astype(the_plan.compute_dtype)
    parts = (x_c[:, 0::2], x_c[:, 1::2]) if the_plan.pieces == 2 else (x_c,)
    (y_MxN,) = _call(the_plan, False, parts, codes, scales)
    return y_MxN, (codes, scales, jnp.zeros((0,), x_MxK.dtype))


def _product_bwd(the_plan, residuals, dy_MxN):
    codes, scales, x_proto = residuals
    parts = _call(the_plan, True, (dy_MxN.astype(the_plan.compute_dtype),), codes, scales)
    M = dy_MxN.shape[0]
    dx_MxK = jnp.stack(parts, axis=-1).reshape(M, -1) if len(parts) == 2 else parts[0]
    return dx_MxK.astype(x_proto.dtype), None, None


_product.defvjp(_product_fwd, _product_bwd)


def _call(p: Plan, transpose: bool, acts, codes, scales):
    """The kernel over its grid: forward ``[M, out]`` from ``acts`` (the rows: NF4 their even
    and odd columns), or, ``transpose``, the row gradients ``[M, code rows]`` (NF4: of the even
    and the odd inputs) from ``acts = (dy,)``. Each a tuple of FP32 arrays."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import tpu as pltpu

    M = acts[0].shape[0]
    tm, tn, tk = p.tm, p.tn, p.tk
    if transpose:  # grid (rows, code rows, outputs): the outputs are summed over
        grid = (M // tm, p.rows // tk, p.n // tn)
        act_spec = pl.BlockSpec((tm, tn), lambda i, k, j: (i, j))
        out_spec = pl.BlockSpec((tm, tk), lambda i, k, j: (i, k))
        outs = [jax.ShapeDtypeStruct((M, p.rows), F32)] * p.pieces
    else:  # grid (rows, outputs, code rows): the code rows are summed over
        grid = (M // tm, p.n // tn, p.rows // tk)
        act_spec = pl.BlockSpec((tm, tk), lambda i, j, k: (i, k))
        out_spec = pl.BlockSpec((tm, tn), lambda i, j, k: (i, j))
        outs = [jax.ShapeDtypeStruct((M, p.n), F32)]

    def tile(at):  # (code rows, outputs) block of the grid step's indices
        return (lambda i, k, j: at(k, j)) if transpose else (lambda i, j, k: at(k, j))

    per_channel = p.scale_rows == 1
    code_spec = pl.BlockSpec((tk, tn), tile(lambda k, j: (k, j)))
    scale_spec = pl.BlockSpec(
        (p.scale_tile, tn), tile(lambda k, j: (0, j) if per_channel else (k, j))
    )
    weight_bytes = codes.size * codes.dtype.itemsize + scales.size * 4
    act_bytes = sum(a.size * a.dtype.itemsize for a in acts)
    cost = pl.CostEstimate(
        flops=2 * M * p.rows * p.pieces * p.n,
        transcendentals=0,
        # the weights once per row tile, the rows once per weight column (or row) tile
        bytes_accessed=int(
            weight_bytes * grid[0] + act_bytes * grid[1] + 4 * sum(o.size for o in outs)
        ),
    )
    return tuple(
        pl.pallas_call(
            functools.partial(_kernel, p, transpose, len(acts)),
            out_shape=outs,
            grid=grid,
            in_specs=[act_spec] * len(acts) + [code_spec, scale_spec],
            out_specs=[out_spec] * len(outs),
            compiler_params=pltpu.CompilerParams(
                dimension_semantics=("parallel", "parallel", "arbitrary"),
                vmem_limit_bytes=VMEM_LIMIT_BYTES,
            ),
            cost_estimate=cost,
            interpret=jax.default_backend() != "tpu",
        )(*acts, codes, scales)
    )


def _kernel(p: Plan, transpose: bool, n_acts: int, *refs):
    """One grid step: zero the output tiles at the first step of the summed axis, make the
    weight tile(s) back, add their product."""
    from jax.experimental import pallas as pl

    acts, (codes_ref, scales_ref), outs = (
        refs[:n_acts],
        refs[n_acts : n_acts + 2],
        refs[n_acts + 2 :],
    )

    def zero():
        for out in outs:
            out[...] = jnp.zeros(out.shape, F32)

    pl.when(pl.program_id(2) == 0)(zero)

    weights = _tile_back(p, codes_ref[...], scales_ref)
    if transpose:  # dy [tm, tn] against each [tk, tn] tile, contracted over the outputs
        for out, w in zip(outs, weights, strict=True):
            out[...] += jax.lax.dot_general(
                acts[0][...], w, (((1,), (1,)), ((), ())), preferred_element_type=F32
            )
    else:
        for act, w in zip(acts, weights, strict=True):
            outs[0][...] += jnp.dot(act[...], w, preferred_element_type=F32)


def _tile_back(p: Plan, codes, scales_ref) -> list:
    """The weight tile(s) ``[tk, tn]`` in the compute dtype, made as ``quantize.dequantize``
    makes them: the FP32 value, times its block's FP32 scale, rounded to the base's dtype."""
    if p.scheme == "nf4":
        byte = codes.astype(jnp.int32)  # sign-extended: the shift and mask undo it
        values = [nf4_values((byte >> 4) & 0x0F), nf4_values(byte & 0x0F)]
    else:
        values = [codes.astype(jnp.int32).astype(F32) * _INV127]
    if p.scale_rows == 1:
        scale = jnp.broadcast_to(scales_ref[...], (p.tk, p.tn))
    else:  # each scale row over its block's code rows, at the sublanes' 8-row alignment
        n = p.scale_tile
        scale = jnp.concatenate(
            [jnp.broadcast_to(scales_ref[b : b + 1, :], (p.per_scale, p.tn)) for b in range(n)]
        )
    return [(v * scale).astype(p.base_dtype).astype(p.compute_dtype) for v in values]
