"""A frozen base matrix held in 8 or 4 bits (``model.lora.base_quantization``, QLoRA).

Every matrix is this project's ``[in, out]`` layout, and a block is ``block`` consecutive
inputs of one output column: exactly bitsandbytes' blocks of the row-major HF ``[out, in]``
tensor flattened, when ``block`` divides ``in`` (a block that does not divide is refused).

- ``int8``: absmax (LLM.int8's vector-wise quantization): ``code = round(127 * w / absmax)``
  in ``[-127, 127]``, ``w ≈ code * absmax / 127``; ``block`` None is one block per output
  channel (the whole input column).
- ``nf4``: bitsandbytes' 16-value NormalFloat table (:data:`NF4`), blocks of 64 by default:
  each ``w / absmax`` rounded to the nearest table value, two 4-bit codes per byte (the first
  input of a pair in the high nibble, as bitsandbytes packs them).
- double quantization (either scheme): the FP32 absmax scales, less their mean, quantized once
  more in groups of 256 by int8 absmax (:func:`_scales_quantized`), the mean kept in FP32.
  bitsandbytes uses its 8-bit dynamic (tree) map for this step, which is not reproduced here;
  what the linear map costs is measured in docs/quantized-base.md.

A :class:`QuantizedWeight` is a pytree (codes and scales its leaves; the scheme, block and
shape static), so it passes into jitted steps and is stacked by ``lax.scan`` like any other
layer parameter; :func:`dequantize` makes the matrix back inside each layer's products.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .quantize_table import NF4, NF4_BLOCK, SCALE_GROUP, SCHEMES


def check_block(shape: tuple, scheme: str, block: int | None) -> str | None:
    """Why ``shape`` cannot be quantized in blocks of ``block`` (None: it can)."""
    if len(shape) != 2:
        return f"a quantized matrix is 2-D, not {len(shape)}-D"
    n_in = shape[0]
    if block is None:
        block = NF4_BLOCK if scheme == "nf4" else n_in
    if n_in % block:
        return f"block size {block} does not divide the input dimension {n_in}"
    if scheme == "nf4" and block % 2:
        return f"NF4 packs two codes per byte: block size {block} must be even"
    return None


@jax.tree_util.register_pytree_node_class
class QuantizedWeight:
    """``codes`` (int8 ``[in, out]``, or uint8 ``[in / 2, out]`` packed NF4) and ``scales``
    (FP32 ``[in / block, out]`` absmax; doubly quantized: int8 codes, ``scale_scales`` the
    per-group FP32 absmax and ``offset`` the mean)."""

    def __init__(self, codes, scales, scale_scales, offset, scheme, block, shape, dtype="float32"):
        self.codes, self.scales = codes, scales
        self.scale_scales, self.offset = scale_scales, offset
        self.scheme, self.block, self.shape = scheme, block, shape
        self.dtype = dtype  # what the model sees: the frozen base's ``base_dtype``

    def tree_flatten(self):
        children = (self.codes, self.scales, self.scale_scales, self.offset)
        return children, (self.scheme, self.block, self.shape, self.dtype)

    def held_in(self, dtype: str) -> QuantizedWeight:
        return QuantizedWeight(*self.tree_flatten()[0], *self.tree_flatten()[1][:3], dtype)

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls(*children, *aux)


def _absmax_codes(x, levels: float):
    """Symmetric linear codes of ``x [..., n]`` per last-axis row, and the row absmax."""
    absmax = jnp.max(jnp.abs(x), axis=-1, keepdims=True)
    safe = jnp.where(absmax == 0, 1.0, absmax)
    codes = jnp.round(x / safe * levels).astype(jnp.int8)
    return codes, absmax[..., 0]


def _scales_quantized(scales):
    """Double quantization of the flat FP32 scales: ``(codes, group absmax, mean)``."""
    flat = scales.reshape(-1)
    offset = jnp.mean(flat)
    pad = (-flat.size) % SCALE_GROUP
    groups = jnp.pad(flat - offset, (0, pad)).reshape(-1, SCALE_GROUP)
    codes, group_max = _absmax_codes(groups, 127.0)
    return codes.reshape(-1)[: flat.size].reshape(scales.shape), group_max, offset


def scales_back(w: QuantizedWeight):
    """``w``'s FP32 scales ``[in / block, out]``, decoded where doubly quantized."""
    if w.scale_scales is None:
        return w.scales
    flat = w.scales.reshape(-1).astype(jnp.float32)
    pad = (-flat.size) % SCALE_GROUP
    groups = jnp.pad(flat, (0, pad)).reshape(-1, SCALE_GROUP)
    back = groups * (w.scale_scales[:, None] / 127.0)
    return back.reshape(-1)[: flat.size].reshape(w.scales.shape) + w.offset


def quantize(w_KxN, scheme: str, block: int | None = None, double: bool = False):
    """``w [in, out]`` as a :class:`QuantizedWeight` (see the module); ``block`` None: one
    block per output channel (int8) or 64 (NF4)."""
    if scheme not in SCHEMES:
        raise ValueError(f"unknown quantization {scheme!r} (expected one of {SCHEMES})")
    block = NF4_BLOCK if scheme == "nf4" and block is None else block
    problem = check_block(tuple(w_KxN.shape), scheme, block)
    if problem:
        raise ValueError(problem)
    K, N = w_KxN.shape
    size = K if block is None else block
    blocks_NxBxS = w_KxN.astype(jnp.float32).T.reshape(N, K // size, size)
    if scheme == "int8":
        codes_NxBxS, absmax_NxB = _absmax_codes(blocks_NxBxS, 127.0)
        codes = codes_NxBxS.reshape(N, K).T
    else:
        absmax_NxB = jnp.max(jnp.abs(blocks_NxBxS), axis=-1)
        safe = jnp.where(absmax_NxB == 0, 1.0, absmax_NxB)[..., None]
        table = jnp.asarray(NF4, jnp.float32)
        midpoints = (table[1:] + table[:-1]) / 2  # nearest value: how many midpoints lie below
        index = jnp.searchsorted(midpoints, blocks_NxBxS / safe).astype(jnp.uint8)
        index = index.reshape(N, K // 2, 2)
        codes = ((index[..., 0] << 4) | index[..., 1]).T
    scales = absmax_NxB.T
    scale_scales = offset = None
    if double:
        scales, scale_scales, offset = _scales_quantized(scales)
    return QuantizedWeight(codes, scales, scale_scales, offset, scheme, block, (K, N))


def dequantize(w: QuantizedWeight, dtype=None):
    """The ``[in, out]`` matrix of ``w`` (FP32 products, then ``dtype``; None: ``w.dtype``).

    Made in the stored ``[in, out]`` layout from elementwise operations and broadcasts only
    (no transpose, no gather), so that XLA can fuse it into the operand of the product that
    reads it instead of writing the matrix out first (docs/quantized-base.md)."""
    dtype = jnp.dtype(w.dtype if dtype is None else dtype)
    K, N = w.shape
    size = K if w.block is None else w.block
    if w.scheme == "int8":
        values_KxN = w.codes.astype(jnp.float32) / 127.0
    else:
        # a byte's high nibble is the first input of its pair: shift each byte by 4 and by 0
        # on a new axis beside the input axis, which then folds into it
        shifts_1x2x1 = jnp.asarray([4, 0], jnp.uint8).reshape(1, 2, 1)
        index_K2x2xN = (w.codes[:, None, :] >> shifts_1x2x1) & 0x0F
        values_KxN = nf4_values(index_K2x2xN.reshape(K, N))
    scales_Bx1xN = scales_back(w)[:, None, :]
    values_BxSxN = values_KxN.reshape(K // size, size, N) * scales_Bx1xN
    return values_BxSxN.reshape(K, N).astype(dtype)


def made_back_after(tree, x):
    """``tree`` (a layer's parameters) with its quantized matrices made to depend on ``x``
    (the layer's input): the same codes, so that each layer's matrices are made
    back where the layer runs, not before.

    A quantized matrix is made back inside the product that reads it
    (:func:`.layers.primitives.linear`), from the codes alone. Where layers run as a Python
    loop (generation's cached step) that work depends on nothing the layers compute, and
    XLA:CPU moves it out of the loop over tokens and schedules it before the first layer:
    the whole base made back at once (docs/quantized-base.md). An optimization barrier keeps
    it in the loop but not in order (XLA:CPU turns barriers into nothing before it
    schedules); a data dependence holds both: each code is XORed with ``isnan(v) &
    isinf(v)`` of one element ``v`` of ``x``, false for every value (the codes unchanged, no
    number changes) but not something XLA can fold. A tree without quantized matrices is
    returned as it is."""
    if not any(map(_is_weight, jax.tree.leaves(tree, is_leaf=_is_weight))):
        return tree
    v = x.reshape(-1)[0]
    never = jnp.isnan(v) & jnp.isinf(v)

    def tied(leaf):
        if not _is_weight(leaf):
            return leaf
        (codes, *rest), aux = leaf.tree_flatten()
        return QuantizedWeight.tree_unflatten(aux, (codes ^ never.astype(codes.dtype), *rest))

    return jax.tree.map(tied, tree, is_leaf=_is_weight)


def _is_weight(leaf) -> bool:
    return isinstance(leaf, QuantizedWeight)


def nf4_values(index):
    """``NF4[index]`` by a tree of selects on the index's four bits (15 selects between the
    table's FP32 constants, the same values as indexing it): a gather, which XLA does not fuse
    into a product's operand, is what this avoids. ``lax.select`` of constants broadcast here:
    through ``jnp.where`` XLA:CPU hoists the 16 broadcast constants out of the layer loop as
    FP32 matrices, which the made-back matrix then reads (tests/test_dequantize_fusion.py)."""
    values = [jax.lax.broadcast(jnp.float32(v), index.shape) for v in NF4]
    for bit in range(4):
        on = (index & (1 << bit)) != 0
        pairs = zip(values[::2], values[1::2], strict=True)
        values = [jax.lax.select(on, high, low) for low, high in pairs]
    return values[0]


def is_quantized(path: str, ndim: int) -> bool:
    """Whether a base parameter is held quantized: every matrix of the blocks (QLoRA's
    linear layers); embeddings, the head, norms and biases stay as the base holds them."""
    return path.startswith("blocks/") and ndim == 2
