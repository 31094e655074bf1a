"""models/quantize.py against a float64 NumPy implementation written here from the QLoRA paper
(Dettmers et al. 2023) and bitsandbytes' definitions: the HF ``[out, in]`` tensor flattened
row-major, cut into blocks, each block's absmax, values rounded to the nearest NF4 table value
(or to ``round(127 * x / absmax)``), two 4-bit codes per byte with the first in the high nibble;
double quantization: the scales less their mean in groups of 256, int8 absmax."""

import statistics

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


@pytest.mark.parametrize("shape", [(128, 24), (192, 5)])
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


@pytest.mark.parametrize("shape", [(128, 64), (64, 3)])  # 256 scales; 3 (a partial group)
def test_double_quantization_equals_the_reference(shape):
    w = weights(shape, seed=2)
    single = quantize.quantize(jnp.asarray(w), "nf4")
    double = quantize.quantize(jnp.asarray(w), "nf4", double=True)
    np.testing.assert_array_equal(np.asarray(double.codes), np.asarray(single.codes))
    absmax = np.asarray(single.scales, np.float64).T.reshape(-1)
    scales = ref_double(absmax)
    ours = np.asarray(quantize._scales_back(double), np.float64).T.reshape(-1)
    np.testing.assert_allclose(ours, scales, rtol=1e-5)
    assert np.asarray(double.scales).dtype == np.int8
    back = np.asarray(quantize.dequantize(double)).T.reshape(-1)
    expected = ref_nf4_back(flat_codes(double.codes), scales)
    np.testing.assert_allclose(back, expected, rtol=1e-5, atol=1e-9)


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
