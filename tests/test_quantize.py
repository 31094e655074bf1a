"""models/quantize.py against a float64 NumPy implementation written here from the QLoRA paper
(Dettmers et al. 2023) and bitsandbytes' definitions: the HF ``[out, in]`` tensor flattened
row-major, cut into blocks, each block's absmax, values rounded to the nearest NF4 table value
(or to ``round(127 * x / absmax)``), two 4-bit codes per byte with the first in the high nibble;
double quantization: the scales less their mean in groups of 256, int8 absmax."""

import statistics

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from minifield.models import quantize

# Written out from bitsandbytes' csrc/kernels.cu (nf4_dequantization_lut), QLoRA appendix E.
NF4_TABLE = np.array(
    [
        -1.0,
        -0.6961928009986877,
        -0.5250730514526367,
        -0.39491748809814453,
        -0.28444138169288635,
        -0.18477343022823334,
        -0.09105003625154495,
        0.0,
        0.07958029955625534,
        0.16093020141124725,
        0.24611230194568634,
        0.33791524171829224,
        0.44070982933044434,
        0.5626170039176941,
        0.7229568362236023,
        1.0,
    ],
    dtype=np.float64,
)


def ref_blocks(w_out_in: np.ndarray, block: int) -> tuple[np.ndarray, np.ndarray]:
    flat = w_out_in.astype(np.float64).reshape(-1, block)
    absmax = np.abs(flat).max(axis=1)
    return flat, absmax


def ref_nf4(w_out_in, block=64):
    """(packed bytes in bitsandbytes' flat order, absmax per block, nearness margin)."""
    flat, absmax = ref_blocks(w_out_in, block)
    normed = flat / np.where(absmax == 0, 1.0, absmax)[:, None]
    distance = np.abs(normed.reshape(-1)[:, None] - NF4_TABLE[None, :])
    index = np.argmin(distance, axis=1)
    ordered = np.sort(distance, axis=1)
    margin = ordered[:, 1] - ordered[:, 0]  # how far from a tie between two table values
    packed = (index[0::2] << 4) | index[1::2]
    return packed.astype(np.uint8), absmax, margin


def ref_nf4_back(packed, absmax, block=64):
    index = np.stack([packed >> 4, packed & 0x0F], axis=1).reshape(-1)
    return (NF4_TABLE[index].reshape(-1, block) * absmax[:, None]).reshape(-1)


def ref_int8(w_out_in, block):
    flat, absmax = ref_blocks(w_out_in, block)
    scaled = 127.0 * flat / np.where(absmax == 0, 1.0, absmax)[:, None]
    return np.round(scaled).astype(np.int8), absmax, np.abs(np.abs(scaled % 1) - 0.5)


def ref_double(absmax, group=256):
    offset = absmax.mean()
    centred = absmax - offset
    out = np.empty_like(centred)
    for start in range(0, centred.size, group):
        part = centred[start : start + group]
        top = np.abs(part).max()
        out[start : start + group] = np.round(127.0 * part / top) * top / 127.0
    return out + offset


def weights(shape_in_out, seed=0):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal(shape_in_out) * 0.05).astype(np.float32)


def flat_codes(codes_KxN) -> np.ndarray:
    """Our ``[in, out]`` codes in bitsandbytes' flat order (the ``[out, in]`` rows)."""
    return np.asarray(codes_KxN).T.reshape(-1)


# (128, 24) in the slow tier: the fast tier keeps (192, 5), the same code on other counts
@pytest.mark.parametrize("shape", [pytest.param((128, 24), marks=pytest.mark.slow), (192, 5)])
def test_nf4_codes_and_values_equal_the_reference(shape):
    w = weights(shape)
    q = quantize.quantize(jnp.asarray(w), "nf4")
    packed, absmax, margin = ref_nf4(w.T)
    ours = flat_codes(q.codes)
    assert ours.dtype == np.uint8 and ours.size == w.size // 2
    clear = (margin[0::2] > 1e-6) & (margin[1::2] > 1e-6)  # FP32 vs FP64 ties aside
    assert clear.mean() > 0.99
    np.testing.assert_array_equal(ours[clear], packed[clear])
    np.testing.assert_allclose(np.asarray(q.scales).T.reshape(-1), absmax, rtol=1e-7)
    back = np.asarray(quantize.dequantize(q)).T.reshape(-1)
    np.testing.assert_allclose(back, ref_nf4_back(ours, absmax), rtol=1e-6, atol=1e-9)


def test_the_written_out_table_is_qloras_construction():
    """The NF4 table above, against how QLoRA builds it (bitsandbytes' ``create_normal_map``,
    offset 0.9677083): 8 positive and 7 negative normal quantiles over float32 ``linspace``
    steps, with 0, scaled to [-1, 1]; equal within float32 rounding (bitsandbytes computes in
    float32), so the table is not only a copy of the one in the code."""
    quantile = statistics.NormalDist().inv_cdf

    def steps(n):
        return np.linspace(0.9677083, 0.5, n, dtype=np.float32)[:-1]

    positive = [quantile(float(p)) for p in steps(9)]
    negative = [-quantile(float(p)) for p in steps(8)]
    values = np.sort(np.array(positive + [0.0] + negative))
    np.testing.assert_allclose(values / values.max(), NF4_TABLE, rtol=0, atol=3e-7)
    np.testing.assert_array_equal(np.asarray(quantize.NF4, np.float64), NF4_TABLE)


def test_nf4_table_values_round_trip_exactly():
    """A block holding every table value times its absmax comes back unchanged."""
    column = np.concatenate([NF4_TABLE] * 4) * 0.25
    w = np.stack([column, column[::-1]], axis=1).astype(np.float32)  # [64, 2]
    back = quantize.dequantize(quantize.quantize(jnp.asarray(w), "nf4"))
    np.testing.assert_array_equal(np.asarray(back), w)


@pytest.mark.parametrize("block", [None, 32])
def test_int8_codes_and_values_equal_the_reference(block):
    w = weights((96, 7), seed=1)
    q = quantize.quantize(jnp.asarray(w), "int8", block)
    codes, absmax, margin = ref_int8(w.T, block or w.shape[0])
    clear = margin.reshape(-1) > 1e-4
    np.testing.assert_array_equal(flat_codes(q.codes)[clear], codes.reshape(-1)[clear])
    ours = flat_codes(q.codes).astype(np.float64).reshape(-1, block or w.shape[0])
    expected = (ours * absmax[:, None] / 127.0).reshape(-1)
    back = np.asarray(quantize.dequantize(q)).T.reshape(-1)
    np.testing.assert_allclose(back, expected, rtol=1e-6)
    assert np.max(np.abs(back - w.T.reshape(-1))) <= np.max(absmax) / 254 * (1 + 1e-6)


# 256 scales (in the slow tier); 3, a partial group (the fast tier keeps it)
@pytest.mark.parametrize("shape", [pytest.param((128, 64), marks=pytest.mark.slow), (64, 3)])
def test_double_quantization_equals_the_reference(shape):
    w = weights(shape, seed=2)
    single = quantize.quantize(jnp.asarray(w), "nf4")
    double = quantize.quantize(jnp.asarray(w), "nf4", double=True)
    np.testing.assert_array_equal(np.asarray(double.codes), np.asarray(single.codes))
    absmax = np.asarray(single.scales, np.float64).T.reshape(-1)
    scales = ref_double(absmax)
    ours = np.asarray(quantize.scales_back(double), np.float64).T.reshape(-1)
    np.testing.assert_allclose(ours, scales, rtol=1e-5)
    assert np.asarray(double.scales).dtype == np.int8
    back = np.asarray(quantize.dequantize(double)).T.reshape(-1)
    expected = ref_nf4_back(flat_codes(double.codes), scales)
    np.testing.assert_allclose(back, expected, rtol=1e-5, atol=1e-9)


def bits(array) -> np.ndarray:
    """The array's bits (a sign of zero included), as unsigned integers of its width."""
    array = np.asarray(array)
    return array.view(f"u{array.dtype.itemsize}")


def random_weight(scheme, shape, block, double, seed=0):
    """A :class:`QuantizedWeight` of random codes (every byte value) and scales: the bits of
    :func:`quantize.dequantize` do not depend on how the codes were made."""
    K, N = shape
    rng = np.random.default_rng(seed)
    if scheme == "nf4":
        codes = rng.integers(0, 256, (K // 2, N), dtype=np.uint8)
    else:
        codes = rng.integers(-127, 128, (K, N)).astype(np.int8)
    scale_shape = (K // (block or K), N)
    scales = rng.standard_normal(scale_shape) * 10.0 ** rng.uniform(-4, 2, scale_shape)
    scales, scale_scales, offset = jnp.asarray(scales, jnp.float32), None, None
    if double:  # int8 scale codes, one FP32 absmax per group of 256, the FP32 mean
        scales = jnp.asarray(rng.integers(-127, 128, scale_shape), jnp.int8)
        groups = -(-scales.size // quantize.SCALE_GROUP)
        scale_scales = jnp.asarray(rng.uniform(0.0, 3.0, groups), jnp.float32)
        offset = jnp.float32(rng.uniform(-1.0, 1.0))
    return quantize.QuantizedWeight(
        jnp.asarray(codes), scales, scale_scales, offset, scheme, block, shape
    )


@pytest.mark.parametrize(
    ("scheme", "shape", "block"),
    [
        ("nf4", (128, 40), 64),
        ("nf4", (96, 24), 2),
        ("int8", (128, 40), None),
        ("int8", (96, 24), 16),
    ],
)
def test_dequantized_matrix_is_the_float32_reference_to_the_bit(scheme, shape, block):
    """Each value ``table[code] * scale`` (NF4) or ``code * (1/127) * scale`` (int8) as one
    FP32 product each, then rounded once to BF16, computed by NumPy in bitsandbytes' flat
    order: equal bit for bit, run op by op and jitted. XLA makes the int8 division by the
    constant 127 a product by its FP32 reciprocal (16 of the 255 codes' values then differ in
    their last bit from a correctly rounded division), so the reference does too."""
    w = random_weight(scheme, shape, block, double=False)
    size = block or shape[0]
    if scheme == "nf4":
        packed = flat_codes(w.codes)
        index = np.stack([packed >> 4, packed & 0x0F], axis=1).reshape(-1)
        values = NF4_TABLE.astype(np.float32)[index]
    else:
        values = flat_codes(w.codes).astype(np.float32) * (np.float32(1) / np.float32(127))
    scales = np.asarray(w.scales).T.reshape(-1, 1)
    expected = (values.reshape(-1, size) * scales).reshape(shape[1], shape[0]).T
    for dtype in ("float32", "bfloat16"):
        reference = expected.astype(jnp.dtype(dtype))
        for made in (
            quantize.dequantize(w, dtype),
            jax.jit(quantize.dequantize, static_argnums=1)(w, dtype),
        ):
            assert made.dtype == reference.dtype
            np.testing.assert_array_equal(bits(made), bits(reference))


def gathered(w, dtype):
    """The formulation before the fused one (in the ``[out, in]`` layout, the NF4 table
    gathered), kept to check that the bits did not move where the scales are double-quantized:
    their multiply-add is one FMA or two roundings as XLA fuses it, in both formulations alike."""
    K, N = w.shape
    size = K if w.block is None else w.block
    scales_NxB = quantize.scales_back(w).T
    if w.scheme == "int8":
        values_NxK = w.codes.T.astype(jnp.float32) / 127.0
    else:
        packed_NxK2 = w.codes.T
        index = jnp.stack([packed_NxK2 >> 4, packed_NxK2 & 0x0F], axis=-1).reshape(N, K)
        values_NxK = jnp.asarray(quantize.NF4, jnp.float32)[index]
    values = values_NxK.reshape(N, K // size, size) * scales_NxB[..., None]
    return values.reshape(N, K).T.astype(dtype)


@pytest.mark.slow  # 16 compilations: 1 s each parameter
@pytest.mark.parametrize(
    ("scheme", "block"), [("nf4", 64), ("nf4", 16), ("int8", None), ("int8", 32)]
)
def test_double_quantized_matrix_has_the_gathered_formulations_bits(scheme, block):
    w = random_weight(scheme, (256, 300), block, double=True, seed=3)
    for dtype in ("float32", "bfloat16"):
        eager = (quantize.dequantize(w, dtype), gathered(w, dtype))
        jitted = [jax.jit(f, static_argnums=1)(w, dtype) for f in (quantize.dequantize, gathered)]
        for ours, theirs in (eager, jitted):
            np.testing.assert_array_equal(
                np.asarray(ours, np.float32), np.asarray(theirs, np.float32)
            )


def test_a_zero_block_stays_zero():
    w = np.zeros((64, 2), np.float32)
    for scheme in quantize.SCHEMES:
        back = quantize.dequantize(quantize.quantize(jnp.asarray(w), scheme))
        np.testing.assert_array_equal(np.asarray(back), w)


@pytest.mark.parametrize(
    "shape, scheme, block, expected",
    [
        ((96, 4), "nf4", None, "block size 64 does not divide the input dimension 96"),
        ((96, 4), "int8", 64, "block size 64 does not divide the input dimension 96"),
        ((63, 4), "nf4", 63, "must be even"),
        ((4, 4, 4), "int8", None, "2-D"),
    ],
)
def test_shapes_the_block_does_not_divide_are_refused(shape, scheme, block, expected):
    with pytest.raises(ValueError, match=expected):
        quantize.quantize(jnp.zeros(shape), scheme, block)


@pytest.mark.parametrize("scheme", quantize.SCHEMES)
def test_made_back_after_keeps_every_code(scheme):
    """Whatever the layer's input holds (its first element NaN, infinite or finite), each code's
    bits are the original's; the rest of the tree is untouched, and a tree without quantized
    matrices comes back as it was given (generation's step, test_quantized_generation.py)."""
    rng = np.random.default_rng(1)
    w = quantize.quantize(jnp.asarray(rng.standard_normal((128, 8)), jnp.float32), scheme, 64)
    norm = jnp.ones((8,))
    plain = {"norm": norm}
    assert quantize.made_back_after(plain, jnp.ones((2, 3))) is plain
    for first in (np.nan, np.inf, -np.inf, 0.0, -2.5):
        x = jnp.full((2, 3, 4), 1.0).at[0, 0, 0].set(first)
        tree = quantize.made_back_after({"w": w, "norm": norm}, x)
        assert tree["norm"] is norm
        held = tree["w"]
        assert isinstance(held, quantize.QuantizedWeight)
        assert held.codes.dtype == w.codes.dtype
        np.testing.assert_array_equal(np.asarray(held.codes), np.asarray(w.codes))
        assert held.tree_flatten()[1] == w.tree_flatten()[1]
        assert held.scales is w.scales
