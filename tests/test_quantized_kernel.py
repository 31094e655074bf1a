"""The quantized product's Pallas kernel (``models.layers.tpu_quantized``), in Pallas's
interpreter on CPU, against a float64 NumPy reference made here from the codes (NF4's table
from bitsandbytes, ``code / 127`` for int8, times each block's scale, double-quantized
scales decoded in float64), and against the XLA path (``quantize.dequantize`` and the
product).

The bound, per output, of ``x @ W`` with ``K`` terms (``dx = dy @ W^T``: the ``N`` outputs'
terms), from the operands' roundings: BF16's unit roundoff ``u = 2^-8``, FP32's ``v = 2^-24``.
The kernel's weight is ``W' = bf16(fp32(value * s'))`` with ``s'`` the FP32 scale, within
``δs`` of the exact one (0 for FP32 scales; decoded from double quantization, ``c · ss / 127
+ offset`` in FP32, within ``4v (|c · ss / 127| + |offset|)``); so ``|W' - W| ≤ e = (|W| +
|value| δs)(u + v + uv) + |value| δs``. The row ``x' = bf16(x)``, ``|x' - x| ≤ u |x|``. Each
product ``x' W'`` is exact in FP32 (8-bit significands); summed in FP32 in any order, within
``γ_K = K v / (1 - K v)`` of ``Σ |x' W'|``. Together:

    |y - y64| ≤ (1 + u) |x| @ e + u |x| @ |W| + γ_K (1 + u) |x| @ (|W| + e)

The XLA path obeys the same bound, so the two differ by at most twice it. The made-back
matrix itself is the float32 reference's bits: the identity's product is exact.
"""

from __future__ import annotations

from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_quantize import NF4_TABLE, bits, random_weight

from minifield.models import execution, quantize
from minifield.models.layers import primitives, tpu_quantized

U, V = 2.0**-8, 2.0**-24
K, N = 512, 256
#: (scheme, block, double quantization, tiles): several tiles on every axis where the
#: blocks allow (a tile's scale rows: 8 or all), 18 rows padded to 32
CASES = [
    ("int8", None, False, (16, 128, 128)),
    ("int8", 16, True, (16, 128, 128)),
    ("nf4", 16, True, (16, 128, 128)),
    ("nf4", 64, False, (16, 128, 256)),
    ("nf4", 64, True, None),
]


def reference(w: quantize.QuantizedWeight):
    """``(W, |value|, δs)`` in float64 ``[K, N]``, from the codes and the stored scales."""
    codes = np.asarray(w.codes)
    if w.scheme == "nf4":
        index = np.stack([codes >> 4, codes & 0x0F], axis=1).reshape(K, N)
        values = NF4_TABLE[index]
    else:
        values = codes.astype(np.float64) / 127.0
    if w.scale_scales is None:
        scales, error = np.asarray(w.scales, np.float64), 0.0
    else:
        group = np.repeat(np.asarray(w.scale_scales, np.float64), quantize.SCALE_GROUP)
        part = np.asarray(w.scales, np.float64) * group[: w.scales.size].reshape(w.scales.shape)
        part /= 127.0
        offset = float(w.offset)
        scales = part + offset
        error = 4 * V * (np.abs(part) + abs(offset))
    size = w.block or K
    per_row = lambda a: np.repeat(np.broadcast_to(a, scales.shape), size, axis=0)  # noqa: E731
    return values * per_row(scales), np.abs(values), per_row(error)


def bound(a, w, value, error, terms):
    """The bound above for ``a @ w`` (``a`` float64, ``w`` its reference weights)."""
    e = (np.abs(w) + value * error) * (U + V + U * V) + value * error
    gamma = terms * V / (1 - terms * V)
    a = np.abs(a)
    return (1 + U) * a @ e + U * a @ np.abs(w) + gamma * (1 + U) * a @ (np.abs(w) + e)


def weight(scheme, block, double, seed=0):
    return random_weight(scheme, (K, N), block, double, seed).held_in("bfloat16")


def xla_path(x, w):
    """Today's product: the matrix made back by XLA, then the BF16 product."""
    return primitives.einsum(
        SimpleNamespace(compute_dtype="bfloat16", dtype=jnp.float32),
        "mk,kn->mn", x, quantize.dequantize(w), out_dtype=jnp.float32,
    )  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize(("scheme", "block", "double", "tiles"), CASES)
def test_product_and_row_gradient_within_the_bound_of_float64_and_of_the_xla_path(
    scheme, block, double, tiles
):
    w = weight(scheme, block, double)
    rng = np.random.default_rng(1)
    x = rng.standard_normal((18, K)).astype(np.float32)
    dy = rng.standard_normal((18, N)).astype(np.float32)
    ours = lambda x: tpu_quantized.matmul("bfloat16", x, w, tiles)  # noqa: E731
    y, pull = jax.vjp(ours, jnp.asarray(x))
    (dx,) = pull(jnp.asarray(dy))
    y_xla, pull_xla = jax.vjp(lambda x: xla_path(x, w), jnp.asarray(x))
    (dx_xla,) = pull_xla(jnp.asarray(dy))
    assert y.dtype == dx.dtype == jnp.float32
    W, value, error = reference(w)
    for got, xla, a, w64, b in (
        (y, y_xla, x, W, bound(x, W, value, error, K)),
        (dx, dx_xla, dy, W.T, bound(dy, W.T, value.T, error.T, N)),
    ):
        ref = a @ w64
        got, xla = np.asarray(got, np.float64), np.asarray(xla, np.float64)
        assert np.all(np.abs(got - ref) <= b), np.max(np.abs(got - ref) / b)
        assert np.all(np.abs(xla - ref) <= b)  # the bound holds for today's path too
        assert np.all(np.abs(got - xla) <= 2 * b)
        # not vacuous: about two BF16 roundings of the terms' magnitudes, no more
        assert np.all(b <= 0.01 * (np.abs(a) @ np.abs(w64)))


@pytest.mark.parametrize(
    ("scheme", "block"), [pytest.param("nf4", 16, marks=pytest.mark.slow), ("int8", None)]
)  # NF4's select tree takes 1.6 s to trace and interpret
def test_the_made_back_matrix_is_the_float32_references_bits(scheme, block):
    """The identity's product is the weight tile exactly (one nonzero term a sum): equal, bit
    for bit, to ``table[code] * scale`` (int8 ``code * (1/127) * scale``, XLA's form of the
    division) in float32 rounded once to BF16, as ``quantize.dequantize`` makes it, and its
    transpose through the row gradient (a zero's sign aside)."""
    w = random_weight(scheme, (128, 128), block, double=False).held_in("bfloat16")
    codes = np.asarray(w.codes)
    if scheme == "nf4":
        index = np.stack([codes >> 4, codes & 0x0F], axis=1).reshape(128, 128)
        values = NF4_TABLE.astype(np.float32)[index]
    else:
        values = codes.astype(np.float32) * (np.float32(1) / np.float32(127))
    scales = np.repeat(np.asarray(w.scales), block or 128, axis=0)
    # + 0: a product's zero is +0 whatever the weight's sign (-0 × 1 + 0 × ... = +0)
    expected = (values * scales).astype(jnp.bfloat16).astype(np.float32) + np.float32(0)
    eye = jnp.eye(128, dtype=jnp.float32)
    made, pull = jax.vjp(lambda x: tpu_quantized.matmul("bfloat16", x, w), eye)
    np.testing.assert_array_equal(bits(made), bits(expected))
    np.testing.assert_array_equal(bits(pull(eye)[0]), bits(expected.T))
    made_by_xla = quantize.dequantize(w).astype(jnp.float32) + np.float32(0)
    np.testing.assert_array_equal(bits(made_by_xla), bits(made))


@pytest.mark.slow
def test_linear_with_the_kernel_forced_keeps_the_adapters_gradients_bit_for_bit():
    """``primitives.linear`` on a LoRA weight over an NF4 base, ``Execution.quantized_kernel``
    ``pallas`` against ``xla``: the output and the rows' gradient within the bound (the
    adapter's term is the same on both), the adapters' gradients equal (they do not read
    the base)."""
    w = weight("nf4", 16, True)
    rng = np.random.default_rng(2)
    x = jnp.asarray(rng.standard_normal((2, 9, K)), jnp.float32)
    a = jnp.asarray(rng.standard_normal((K, 4)) * 0.05, jnp.float32)
    b = jnp.asarray(rng.standard_normal((4, N)) * 0.05, jnp.float32)
    dy = jnp.asarray(rng.standard_normal((2, 9, N)), jnp.float32)

    def run(kernel):
        cfg = SimpleNamespace(
            compute_dtype="bfloat16", dtype=jnp.float32,
            execution=execution.Execution(quantized_kernel=kernel),
        )  # fmt: skip
        step = lambda x, a, b: primitives.linear(cfg, x, primitives.LoraWeight(w, a, b, 2.0))  # noqa: E731
        y, pull = jax.vjp(step, x, a, b)
        return (y, *pull(dy))

    (y, dx, da, db), (y_xla, dx_xla, da_xla, db_xla) = run("pallas"), run("xla")
    np.testing.assert_array_equal(bits(da), bits(da_xla))
    np.testing.assert_array_equal(bits(db), bits(db_xla))
    W, value, error = reference(w)
    x64, dy64 = np.asarray(x, np.float64).reshape(18, K), np.asarray(dy, np.float64).reshape(18, N)
    for got, xla, b in (
        (y, y_xla, bound(x64, W, value, error, K)),
        (dx, dx_xla, bound(dy64, W.T, value.T, error.T, N)),
    ):
        got = np.asarray(got, np.float64).reshape(b.shape)
        xla = np.asarray(xla, np.float64).reshape(b.shape)
        # twice the bound, and the adapter's term added to each in FP32 (one rounding)
        assert np.all(np.abs(got - xla) <= 2 * b + 2 * V * np.abs(xla))


def test_float32_compute_and_blocks_no_tile_holds_are_refused():
    w = weight("int8", 16, False)
    with pytest.raises(ValueError, match="bfloat16 only"):
        tpu_quantized.plan(w, 16, "float32")
    # 512 rows in blocks of 256: a 128-row tile holds no whole block
    w = weight("int8", 256, False)
    with pytest.raises(ValueError, match=r"no tile for a int8 matrix 512 x 256 in blocks of 256"):
        tpu_quantized.plan(w, 16, "bfloat16", tiles=(16, 128, 128))
    with pytest.raises(ValueError, match="quantized kernel: expected one of"):
        execution.Execution(quantized_kernel="mosaic")


def test_default_tiles_fit_the_3b_shapes():
    """Llama-3.2-3B's matrices (d 3072, kv 1024, ffn 8192) at 2048 rows: NF4 in blocks of
    64, int8 per channel and in blocks of 64, each gets :data:`TILES` or a divisor of it."""
    for k, n in ((3072, 3072), (3072, 1024), (3072, 8192), (8192, 3072)):
        for scheme, block in (("nf4", 64), ("int8", None), ("int8", 64)):
            w = quantize.QuantizedWeight(None, None, None, None, scheme, block, (k, n))
            p = tpu_quantized.plan(w, 2048, "bfloat16")
            assert (p.tm, p.tn, p.tk) == (2048, 512, 512)
            assert p.rows % p.tk == 0 and p.n % p.tn == 0
            assert p.scale_tile in (1, 8, 16)
