"""What both model families (:mod:`minifield.models.gpt`, :mod:`minifield.models.llama`) and :mod:`.attention` share: the
compute dtypes, the one matrix-product primitive, rotary positions and the initialisation draw
(the checks every model config makes: :mod:`.architecture`, which needs no JAX).

Precision: parameters are FP32 ("master" weights). With ``compute_dtype="bfloat16"`` every
matrix product is a BF16 x BF16 dot accumulating in FP32 (``preferred_element_type``),
through a custom VJP whose backward dots are BF16 x BF16 -> FP32 as well: autodiff of such a
dot would otherwise produce FP32 backward dots, and XLA:CPU only runs the BF16 x BF16 -> FP32
form on its fast (AMX-BF16) path. Weight gradients leave the custom VJP in FP32 without a
BF16 rounding. With ``compute_dtype="float32"`` every product asks for
``Precision.HIGHEST`` (:func:`full_precision`): JAX's default on a TPU is one BF16 pass over
FP32 operands, on a recent GPU TF32; the CPU computes FP32 products in FP32 either way (the
same bits, checked by hand: docs/tpu.md). It is asked per product, not as the process's
default precision, so the model computes the same wherever it is called from (a worker, the
evaluation, a test, a user's script).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from .. import execution
from ..quantize import QuantizedWeight, dequantize

F32 = jnp.float32
BF16 = jnp.bfloat16

ROTARY_BASE = 10000.0


def full_precision(dtype):
    """The ``precision`` of a product of ``dtype`` operands: ``HIGHEST`` for FP32 (FP32 means
    FP32 on every backend), None (the backend's only one) for BF16, which accumulates in FP32
    by ``preferred_element_type``."""
    return jax.lax.Precision.HIGHEST if jnp.dtype(dtype) == F32 else None


def scaled_normal(key, shape, std: float):
    """N(0, std²) samples in FP32, with the same bits whether run op by op or inside one
    jit-compiled initialisation (the sharded one, see ``parallel.sharded_program``): without the
    barrier XLA folds ``std`` into the sampler's own constant factor (sqrt 2) when it sees
    both, which moves the last bit of some values and so the state hash."""
    return jax.lax.optimization_barrier(jax.random.normal(key, shape, F32)) * std


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _bf16_einsum(equation: str, out_dtype, a, b):
    """einsum of ``a`` and ``b`` rounded to BF16, accumulated in FP32, result in ``out_dtype``.

    The operands may be FP32 (master weights): they are rounded inside, and their
    gradients are returned in their own dtype straight from the FP32 accumulator.
    """
    return _bf16_einsum_fwd(equation, out_dtype, a, b)[0]


def _bf16_einsum_fwd(equation, out_dtype, a, b):
    a16, b16 = a.astype(BF16), b.astype(BF16)
    out = jnp.einsum(equation, a16, b16, preferred_element_type=F32).astype(out_dtype)
    # The dtypes of the original operands ride along as zero-size arrays (residuals must be
    # arrays), so the backward pass can return each gradient in its operand's dtype.
    return out, (a16, b16, jnp.zeros((0,), a.dtype), jnp.zeros((0,), b.dtype))


def _bf16_einsum_bwd(equation, out_dtype, residuals, g):
    a16, b16, a_proto, b_proto = residuals
    inputs, out = equation.split("->")
    spec_a, spec_b = inputs.split(",")
    g16 = g.astype(BF16)
    # The transposed-left products (dV = P^T dO, dK = dS^T Q) are still upcast to FP32 by
    # XLA:CPU (its fast path wants the left operand contracting on its last axis, and it
    # folds explicit transposes back into the dot); the weight gradients are not.
    da = jnp.einsum(f"{out},{spec_b}->{spec_a}", g16, b16, preferred_element_type=F32)
    db = jnp.einsum(f"{spec_a},{out}->{spec_b}", a16, g16, preferred_element_type=F32)
    return da.astype(a_proto.dtype), db.astype(b_proto.dtype)


_bf16_einsum.defvjp(_bf16_einsum_fwd, _bf16_einsum_bwd)


def einsum(cfg, equation: str, a, b, out_dtype=None):
    """The models' one matrix-product primitive (precision per ``cfg.compute_dtype``)."""
    out_dtype = cfg.dtype if out_dtype is None else out_dtype
    if cfg.compute_dtype == "float32":
        return jnp.einsum(equation, a, b, precision=full_precision(F32)).astype(out_dtype)
    return _bf16_einsum(equation, out_dtype, a, b)


@jax.tree_util.register_pytree_node_class
class LoraWeight:
    """A frozen ``[in, out]`` matrix with a low-rank adapter (see :mod:`minifield.training.lora`):
    it multiplies as ``x @ base + scale * (x @ a) @ b``. Built inside the traced step only.
    The experts of a mixture hold ``base`` None: :mod:`minifield.models.moe` multiplies their
    stacked ``a [E, in, r]``, ``b [E, r, out]`` group by group."""

    def __init__(self, base, a, b, scale: float):
        self.base, self.a, self.b, self.scale = base, a, b, scale

    def tree_flatten(self):
        return (self.base, self.a, self.b), self.scale

    @classmethod
    def tree_unflatten(cls, scale, children):
        return cls(*children, scale)


def linear(cfg, x_BxTxK, w):
    """x @ w as an FP32 accumulator, for a plain matrix or a :class:`LoraWeight` (whose
    adapter's inner product is rounded to the compute dtype, like any activation). A quantized
    frozen matrix (:mod:`minifield.models.quantize`) is made back here, inside the layer's
    product: by XLA, or by the TPU kernel that reads its codes (``execution``'s
    ``quantized_kernel``, :mod:`.tpu_quantized`)."""
    if isinstance(w, LoraWeight):
        y_BxTxN = linear(cfg, x_BxTxK, w.base)
        down_BxTxR = einsum(cfg, "btk,kr->btr", x_BxTxK, w.a)
        return y_BxTxN + w.scale * einsum(cfg, "btr,rn->btn", down_BxTxR, w.b, out_dtype=F32)
    if isinstance(w, QuantizedWeight):
        how = cfg.execution
        kernel = how.quantized_kernel or execution.quantized_kernel(how.backend, cfg.compute_dtype)
        if kernel == "pallas":  # imported here: Pallas's TPU modules only where it runs
            from . import tpu_quantized

            return tpu_quantized.matmul(cfg.compute_dtype, x_BxTxK, w)
        w = dequantize(w)
    return einsum(cfg, "btk,kn->btn", x_BxTxK, w, out_dtype=F32)


def rotate(x_BxTxHxK, positions_BxT, base: float = ROTARY_BASE, inv_freq_K2=None, scale=1.0):
    """Rotary position embedding (rotate-half form), applied in FP32; ``inv_freq_K2``: the
    frequencies when not the plain ones of ``base`` (see :mod:`minifield.models.rope_scaling`); ``scale``: a factor
    on cos and sin (longrope's ``attention_factor``)."""
    half = x_BxTxHxK.shape[-1] // 2
    if inv_freq_K2 is None:
        inv_freq_K2 = base ** (-jnp.arange(half, dtype=F32) / half)
    angle_BxTx1xK2 = (positions_BxT.astype(F32)[:, :, None] * inv_freq_K2)[:, :, None, :]
    cos, sin = jnp.cos(angle_BxTx1xK2), jnp.sin(angle_BxTx1xK2)
    if scale != 1.0:  # only then: the other models' computation stays as it was
        cos, sin = cos * scale, sin * scale
    x = x_BxTxHxK.astype(F32)
    x1, x2 = x[..., :half], x[..., half:]
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x_BxTxHxK.dtype)
