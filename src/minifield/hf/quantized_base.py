"""A quantized base (``model.lora.base_quantization``) as a product: its codes and scales made
once from the pinned base and the quantization settings, and shared by every computation that
quantizes the same base the same way (docs/quantized-base.md, "The quantized base is a
product").

- :func:`spec` / :func:`digest`: the product's address, the sha256 of the base's weight pins
  (``config.json``, the index, the weight files), the scheme, the block (its effective size:
  NF4's absent block is 64) and double quantization. ``base_dtype`` is not in it: the codes are
  made from the stored values, whatever dtype the step then sees them in. The computation
  digest of a quantized recipe names it (:func:`minifield.strategies.base.computation_fields`).
- :func:`quantize_matrix`: one stored matrix's codes and scales, in NumPy on the host, so the
  same bits on every host and device (a TPU's division is not the CPU's). Equal, bit for bit,
  to :func:`minifield.models.quantize.quantize` on the CPU, but for one definition: the
  double-quantized scales' mean (``offset``) is the float32 of their exactly rounded mean
  (``math.fsum``), where XLA's mean sums in float32 in an order of its own.
- :func:`make` writes the product from prepared examples, matrices quantized side by side by
  a thread each (:func:`quantized_leaves`: the host holds about one matrix's codes a thread,
  never the model's), in the examples' format
  (:mod:`minifield.inputs.examples`: ``.npy`` files and a manifest of their sha256s, the
  manifest last); :func:`load` verifies every sha256 and the address before anything reads
  them, and gives arrays a program finds beside its examples' (:func:`on_device`).

Without a product (a worker started on its own, a program that only evaluates)
:func:`on_device` makes each matrix with :func:`quantize_matrix` as it is put on the device: the same bits.
"""

from __future__ import annotations

import itertools
import math
import os
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from ..digest import sha256_json
from ..inputs import examples
from ..models import quantize_table
from . import stored_base

#: bumped when the same settings make other codes
VERSION = 1
DIGEST_KEY = "quantized_base_digest"
FORMAT = "minifield-quantized-base/1"
#: the prefix of a product's arrays among a program's arrays
PREFIX = "qbase."
#: the leaves of a :class:`~minifield.models.quantize.QuantizedWeight` a product holds
LEAVES = ("codes", "scales", "scale_scales", "offset")
#: output channels quantized at a time: a matrix's float32 copy is made a slice at a time
ROWS = 1024
#: values widened and quantized at a time within them (1 MiB of float32): each of a slice's
#: passes runs in the CPU's cache, not through memory
SLICE_VALUES = 1 << 18
#: the NF4 table as float32 (the values the device's dequantization selects)
NF4 = np.array(quantize_table.NF4, np.float32)
SCHEMES, NF4_BLOCK, SCALE_GROUP = (
    quantize_table.SCHEMES,
    quantize_table.NF4_BLOCK,
    quantize_table.SCALE_GROUP,
)


class QuantizedBaseError(examples.ExamplesError):
    """A product that is missing, altered, or not the recipe's (an invalid input: exit 2)."""


def settings(data: dict) -> tuple[str, int | None, bool] | None:
    """``(scheme, effective block, double)`` of a validated recipe's data; None: unquantized."""
    lora = data["model"].get("lora") or {}
    scheme = lora.get("base_quantization", "none")
    if scheme == "none":
        return None
    block = lora.get("quantization_block")
    block = NF4_BLOCK if scheme == "nf4" and block is None else block
    return scheme, block, bool(lora.get("double_quantization", False))


def spec(data: dict) -> dict | None:
    """What the quantized base of a validated recipe's data depends on (None: unquantized)."""
    found = settings(data)
    if found is None:
        return None
    base = data["model"]["base"]
    names = [base["config"], *base["weights"], *([base["index"]] if "index" in base else [])]
    pinned = {i["name"]: i["sha256"] for i in data["inputs"]}
    scheme, block, double = found
    return {
        "what": "quantized base",
        "version": VERSION,
        "base_inputs": {name: pinned[name] for name in sorted(names)},
        "scheme": scheme,
        "block": block,
        "double_quantization": double,
    }


def digest(data: dict) -> str | None:
    """The product's address (the sha256 of :func:`spec`); None: unquantized."""
    described = spec(data)
    return None if described is None else sha256_json(described)


# ----------------------------------------------------------------------------- quantizing


def _reciprocal(absmax: np.ndarray) -> np.ndarray:
    """``1 / absmax`` (1 for a zero block), broadcast over the block: ``x / absmax`` as XLA
    computes it (its algebraic simplifier makes a division by a broadcast a product with
    the reciprocal), so the codes are :func:`minifield.models.quantize.quantize`'s bits."""
    return (np.float32(1.0) / np.where(absmax == 0, np.float32(1.0), absmax))[..., None]


def _codes(rows_NxBxS: np.ndarray, scheme: str) -> tuple[np.ndarray, np.ndarray]:
    """``(codes [N, B*S] (NF4: packed, [N, B*S/2]), absmax [N, B])`` of float32 blocks (a
    copy of the stored values, overwritten), the float32 operations of
    :func:`minifield.models.quantize.quantize` in its order."""
    absmax = np.max(np.abs(rows_NxBxS), axis=-1)
    normed = rows_NxBxS
    normed *= _reciprocal(absmax)
    N = rows_NxBxS.shape[0]
    if scheme == "int8":
        normed *= np.float32(127.0)
        return np.round(normed, out=normed).astype(np.int8).reshape(N, -1), absmax
    index = _nearest_nf4(normed).reshape(N, -1, 2)
    return (index[..., 0] << 4) | index[..., 1], absmax


#: the midpoints between the NF4 table's neighbours: a value's nearest entry is the number of
#: midpoints below it
_MIDPOINTS = (NF4[1:] + NF4[:-1]) / np.float32(2.0)


def _nearest_nf4(normed: np.ndarray) -> np.ndarray:
    """The NF4 index of each value: ``searchsorted(_MIDPOINTS, normed)`` (the number of
    midpoints below it; NaN sorts last: 15), counted as 15 less the midpoints at or above it
    (a NaN is at or above none), 15 vectorised comparisons: 8 times faster than the binary
    search on this CPU (docs/quantized-base.md)."""
    at_or_above = np.zeros(normed.shape, np.uint8)
    compared = np.empty(normed.shape, bool)
    for midpoint in _MIDPOINTS:
        np.less_equal(normed, midpoint, out=compared)
        at_or_above += compared.view(np.uint8)
    return np.uint8(15) - at_or_above


def _double(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Double quantization of the float32 scales: ``(int8 codes, group absmax, offset)``; the
    offset the float32 of the exactly rounded mean (see the module)."""
    flat = scales.reshape(-1)
    offset = np.float32(math.fsum(flat.astype(np.float64).tolist()) / flat.size)
    pad = (-flat.size) % SCALE_GROUP
    groups = np.pad(flat - offset, (0, pad)).reshape(-1, SCALE_GROUP)
    group_max = np.max(np.abs(groups), axis=-1)
    codes = np.round(groups * _reciprocal(group_max) * np.float32(127.0)).astype(np.int8)
    return codes.reshape(-1)[: flat.size].reshape(scales.shape), group_max, np.asarray(offset)


def quantize_matrix(
    value: np.ndarray, out_in: bool, scheme: str, block: int | None, double: bool
) -> dict[str, np.ndarray | None]:
    """A stored matrix's leaves (:data:`LEAVES`, None where absent) in this project's
    ``[in, out]`` layout: ``value`` is HF's ``[out, in]`` when ``out_in``; float32, bfloat16
    or float16 (widened exactly). Made :data:`ROWS` output channels at a time."""
    N, K = value.shape if out_in else value.shape[::-1]
    size = K if block is None else block
    packed = K // 2 if scheme == "nf4" else K
    codes = np.empty((packed, N), np.uint8 if scheme == "nf4" else np.int8)
    scales = np.empty((K // size, N), np.float32)
    slice_rows = max(1, SLICE_VALUES // K)
    for start in range(0, N, ROWS):
        part = value[start : start + ROWS] if out_in else value[:, start : start + ROWS].T
        part_codes = np.empty((part.shape[0], packed), codes.dtype)
        absmax = np.empty((part.shape[0], K // size), np.float32)
        for at in range(0, part.shape[0], slice_rows):  # a slice's passes run in the cache
            rows = np.array(part[at : at + slice_rows], np.float32)  # a copy: overwritten
            made = _codes(rows.reshape(-1, K // size, size), scheme)
            part_codes[at : at + slice_rows], absmax[at : at + slice_rows] = made
        codes[:, start : start + ROWS] = part_codes.T
        scales[:, start : start + ROWS] = absmax.T
    if not double:
        return {"codes": codes, "scales": scales, "scale_scales": None, "offset": None}
    scale_codes, group_max, offset = _double(scales)
    return {"codes": codes, "scales": scale_codes, "scale_scales": group_max, "offset": offset}


def _quantized(path: str, value: np.ndarray) -> bool:
    """:func:`minifield.models.quantize.is_quantized` (which imports JAX: the rule does not)."""
    return value.ndim == 2 and path.startswith("blocks/")


def make(
    data: dict, arrays: dict[str, np.ndarray], out_dir: Path, threads: int | None = None
) -> dict:
    """Write the quantized base of a validated recipe's ``data`` from its prepared examples'
    ``arrays`` (memory-mapped: a matrix is read as it is quantized) into ``out_dir``; the
    manifest."""
    return write(arrays, Path(out_dir), settings(data), spec(data), threads)


def write(arrays, out_dir: Path, found: tuple, described: dict, threads: int | None = None) -> dict:
    """The product of ``arrays`` quantized by ``found`` (:func:`settings`' triple) written into
    ``out_dir``, addressed by the sha256 of ``described`` (a recipe's :func:`spec`, or a
    benchmark's own description of its base); the manifest."""
    scheme, block, double = found
    leaves = quantized_leaves(arrays, scheme, block, double, threads)
    meta = {"spec": described}
    return examples.write(
        out_dir, leaves, meta, sha256_json(described), digest_key=DIGEST_KEY, kind=FORMAT
    )


def quantized_leaves(arrays, scheme: str, block, double: bool, threads: int | None = None):
    """``(name, array)`` of every block matrix's leaves, in the arrays' order. The matrices are
    quantized side by side by ``threads`` threads (absent: one per CPU this process may run
    on, at most 16; NumPy's passes release the GIL), at most ``threads`` matrices ahead of the
    one given out: the host holds about ``threads`` matrices' codes, never the model's. The
    codes do not depend on it: each matrix is quantized whole by one thread."""
    matrices = (item for item in stored_base.stored(arrays) if _quantized(item[0], item[1]))
    threads = threads or max(1, min(len(os.sched_getaffinity(0)), 16))
    with ThreadPoolExecutor(threads) as pool:
        pending: deque = deque()

        def submit() -> None:
            for path, value, out_in in itertools.islice(matrices, 1):
                made = pool.submit(quantize_matrix, value, out_in, scheme, block, double)
                pending.append((path, made))

        for _ in range(threads):
            submit()
        while pending:
            path, made = pending.popleft()
            leaves = made.result()
            submit()
            for leaf in LEAVES:
                if leaves[leaf] is not None:
                    yield f"{PREFIX}{path.replace('/', '.')}.{leaf}", leaves.pop(leaf)


def load(directory: Path, data: dict) -> dict[str, np.ndarray]:
    """The verified product of a validated recipe's ``data`` (memory-mapped): every file's
    sha256 and the manifest's address checked; a missing, altered or other product is a
    :class:`QuantizedBaseError` naming the file."""
    expected = digest(data)
    if expected is None:
        raise QuantizedBaseError(
            f"{directory}: a quantized base was given, but the recipe does not quantize its base "
            "(model.lora.base_quantization)"
        )
    return read(directory, expected)


def read(directory: Path, expected: str) -> dict[str, np.ndarray]:
    """The verified product at ``directory`` whose address is ``expected`` (see :func:`load`)."""
    try:
        arrays, _ = examples.load(Path(directory), expected, digest_key=DIGEST_KEY)
    except QuantizedBaseError:
        raise
    except (examples.ExamplesError, OSError, ValueError) as exc:
        raise QuantizedBaseError(f"quantized base: {exc}") from None
    return arrays


def on_device(arrays: dict[str, np.ndarray], lora) -> stored_base.FrozenBase:
    """The frozen base of prepared ``arrays`` on the device, every block matrix held as its
    codes and scales (:class:`~minifield.models.quantize.QuantizedWeight`), one matrix at a
    time: the product's when ``arrays`` holds one (:func:`load`), else made here by
    :func:`quantize_matrix` (the same bits). ``lora``: the run's
    :class:`~minifield.training.lora.LoraSettings`; the rest of the base as stored."""
    import jax

    from ..models.quantize import QuantizedWeight

    product = any(name.startswith(PREFIX) for name in arrays)
    block = NF4_BLOCK if lora.quantization == "nf4" and lora.block is None else lora.block
    items, out_in = [], set()
    stored = list(stored_base.stored(arrays))
    host = host_paths(stored)
    for path, value, transposed in stored:
        if not _quantized(path, value):
            items.append((path, jax.device_put(value, _memory(path in host))))
            if transposed:
                out_in.add(path)
            continue
        name = f"{PREFIX}{path.replace('/', '.')}"
        if product and f"{name}.codes" not in arrays:
            raise QuantizedBaseError(f"quantized base: no codes of the matrix {path}")
        if product:
            leaves = {leaf: arrays.get(f"{name}.{leaf}") for leaf in LEAVES}
        else:
            leaves = quantize_matrix(value, transposed, lora.quantization, block, lora.double)
        shape = tuple(value.shape[::-1]) if transposed else tuple(value.shape)  # [in, out]
        weight = QuantizedWeight(
            *(leaves[leaf] for leaf in LEAVES), lora.quantization, block, shape
        )
        items.append((path, jax.device_put(weight)))
    return stored_base.FrozenBase(
        stored_base.nest(items), frozenset(out_in), lora.base_dtype, frozenset(host)
    )


#: the frozen table a quantized base holds in the host's memory where the head is its own
HOST_TABLE = "embed/tokens"


def host_paths(stored: list) -> set[str]:
    """The token embedding, when the base has an untied head: frozen, read only by its rows,
    so it waits in the host's memory (1.05 GB of BF16 at Llama-3.1-8B, a fifth of the 8B
    QLoRA step's arguments; docs/quantized-base.md). A tied one is the head too: it stays."""
    paths = {path for path, _, _ in stored}
    return {HOST_TABLE} if HOST_TABLE in paths and "head/w" in paths else set()


def _memory(host: bool):
    """Where a leaf is placed: the default device, or its host memory (``pinned_host``)."""
    import jax
    from jax.sharding import SingleDeviceSharding

    return SingleDeviceSharding(jax.devices()[0], memory_kind="pinned_host") if host else None
