"""BF16 tensors widened to FP32 (``hf_tensors.read_fp32``, block by block, transposed or
not): every finite BF16 bit pattern against its value computed here from the format's
definition (sign, 8-bit exponent biased by 127, 7-bit mantissa; subnormals at exponent 0),
and −0.0 kept, in both layouts; non-finite values counted and refused naming the file and
tensor."""

from __future__ import annotations

from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from minifield.hf import tensors as hf_tensors
from minifield.hf.config import CheckpointError


def _finite_patterns() -> np.ndarray:
    """All 65,280 finite BF16 bit patterns (exponent not all ones), as [255, 256]."""
    bits = np.arange(1 << 16, dtype=np.uint32)
    return bits[(bits & 0x7F80) != 0x7F80].astype(np.uint16).reshape(255, 256)


def _by_definition(bits: np.ndarray) -> np.ndarray:
    """Each pattern's value in float64 (exact: 8 significant bits)."""
    bits = bits.astype(np.int64)
    sign = np.where(bits >> 15, -1.0, 1.0)
    exponent, mantissa = (bits >> 7) & 0xFF, bits & 0x7F
    normal = np.ldexp(1.0 + mantissa / 128.0, exponent - 127)
    subnormal = np.ldexp(mantissa / 128.0, -126)
    return sign * np.where(exponent > 0, normal, subnormal)


def _read(path: Path, bits: np.ndarray, transpose: bool) -> np.ndarray:
    path.write_bytes(b"pad!" + bits.tobytes())  # at an offset, as in a safetensors file
    dtype = np.dtype(ml_dtypes.bfloat16)
    with hf_tensors.Source(path) as source:
        return hf_tensors.read_fp32(
            source, 4, 4 + bits.nbytes, bits.shape, dtype, transpose, "model.norm.weight"
        )


@pytest.mark.parametrize("transpose", [False, True])
def test_every_finite_bf16_value_widens_exactly(tmp_path, transpose):
    bits = _finite_patterns()
    value = _read(tmp_path / "t.bin", bits, transpose)
    expected = _by_definition(bits)
    if transpose:  # held [in, out]
        expected = expected.T
    assert value.dtype == np.float32 and value.shape == expected.shape
    assert np.array_equal(value.astype(np.float64), expected)
    assert np.array_equal(np.signbit(value), np.signbit(expected))  # -0.0 kept too
    assert value.ctypes.data % 64 == 0


@pytest.mark.parametrize("transpose", [False, True])
def test_bf16_nan_and_infinity_are_counted_and_refused(tmp_path, transpose):
    bits = _finite_patterns()[:67].copy()  # 67 rows: the last block of rows is partial
    bits[66, 255] = 0x7FC1  # a NaN
    bits[3, 0] = 0xFF80  # -inf
    path = tmp_path / "t.bin"
    with pytest.raises(
        CheckpointError, match=f"^{path}: tensor model.norm.weight holds 2 non-finite values"
    ):
        _read(path, bits, transpose)


# -- read as stored (a frozen base, :func:`.tensors.read_stored`) ----------------------------


def _read_stored(path: Path, raw: bytes, shape, kind: str):
    path.write_bytes(b"pad!" + raw)
    with hf_tensors.Source(path) as source:
        return hf_tensors.read_stored(source, 4, 4 + len(raw), shape, kind, "model.norm.weight")


def test_every_finite_bf16_pattern_is_read_as_stored_bit_for_bit(tmp_path):
    bits = _finite_patterns()
    value = _read_stored(tmp_path / "t.bin", bits.tobytes(), bits.shape, "BF16")
    assert value.dtype == ml_dtypes.bfloat16 and value.shape == bits.shape
    assert np.array_equal(value.view(np.uint16), bits)
    assert np.array_equal(value.astype(np.float64), _by_definition(bits))
    assert value.ctypes.data % 64 == 0


@pytest.mark.parametrize(
    ("kind", "dtype", "bad"),
    [
        ("BF16", np.uint16, [0x7FC1, 0xFF80, 0x7F80]),  # NaN, -inf, +inf by their bits
        ("F16", np.float16, [np.nan, -np.inf]),
        ("F32", np.float32, [np.inf]),
    ],
)
def test_non_finite_values_read_as_stored_are_counted_and_refused(tmp_path, kind, dtype, bad):
    # more than one read block (the check runs block by block), the bad values in the last
    count = (1 << 20) + 300
    values = np.zeros(count, dtype)
    values[-len(bad) :] = bad
    path = tmp_path / "t.bin"
    with pytest.raises(
        CheckpointError,
        match=f"^{path}: tensor model.norm.weight holds {len(bad)} non-finite values",
    ):
        _read_stored(path, values.tobytes(), (count,), kind)
    values[-len(bad) :] = 1 if kind != "BF16" else 0x3F80  # 1.0: now all finite
    assert _read_stored(path, values.tobytes(), (count,), kind).shape == (count,)


def test_a_tensor_read_as_stored_past_the_files_end_is_refused(tmp_path):
    path = tmp_path / "t.bin"
    path.write_bytes(b"pad!" + b"\0" * 10)
    with (
        hf_tensors.Source(path) as source,
        pytest.raises(CheckpointError, match=f"^{path}: ends inside a tensor's data"),
    ):
        hf_tensors.read_stored(source, 4, 24, (10,), "BF16", "model.norm.weight")


@pytest.mark.parametrize("transpose", [False, True])
@pytest.mark.parametrize(
    ("dtype", "bad"),
    [(np.float32, [np.nan, -np.inf, np.inf]), (np.float16, [np.inf, np.nan])],
)
def test_fp32_and_f16_widened_bit_for_bit_and_non_finite_refused(tmp_path, transpose, dtype, bad):
    """F32 (read or transposed as it is, no cast) and F16 into the FP32 masters: every value's
    bits kept (-0.0, subnormals, the largest finite), a non-finite one counted and refused;
    67 rows: the last block of rows is partial."""
    info = np.finfo(dtype)
    values = np.random.default_rng(0).standard_normal((67, 130)).astype(dtype)
    values[0, :4] = [-0.0, info.smallest_subnormal, -info.max, info.max]
    path = tmp_path / "t.bin"
    path.write_bytes(b"pad!" + values.tobytes())
    with hf_tensors.Source(path) as source:
        read = hf_tensors.read_fp32(
            source, 4, 4 + values.nbytes, values.shape, np.dtype(dtype), transpose, "model.w"
        )
    expected = values.astype(np.float32)  # exact: every F16 value is an FP32 value
    expected = np.ascontiguousarray(expected.T) if transpose else expected
    assert read.dtype == np.float32 and read.ctypes.data % 64 == 0
    assert np.array_equal(read.view(np.uint32), expected.view(np.uint32))
    values[66, -len(bad) :] = bad
    path.write_bytes(b"pad!" + values.tobytes())
    with (
        hf_tensors.Source(path) as source,
        pytest.raises(
            CheckpointError, match=f"^{path}: tensor model.w holds {len(bad)} non-finite values"
        ),
    ):
        hf_tensors.read_fp32(
            source, 4, 4 + values.nbytes, values.shape, np.dtype(dtype), transpose, "model.w"
        )
