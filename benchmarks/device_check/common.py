"""Helpers every process of the device check uses: progress, the JSON, counts, the device's
memory bandwidth, and the peaks of the parts the issues name."""

from __future__ import annotations

import math
import statistics
import sys
import time
from pathlib import Path

#: nominal peaks of the parts the issues name, by what their JAX ``device_kind`` contains:
#: dense BF16 matrix-multiply FLOP/s (no sparsity; the GPUs' SXM parts), HBM bytes and bytes/s
#: (the vendors' data sheets); the TPU v5e reports itself as "TPU v5 lite"
NOMINAL_PEAKS = {
    "H100": {"bf16_flops": 989e12, "hbm_bytes": 80e9, "hbm_bytes_per_s": 3.35e12},
    "H200": {"bf16_flops": 989e12, "hbm_bytes": 141e9, "hbm_bytes_per_s": 4.8e12},
    "TPU v5 lite": {"bf16_flops": 197e12, "hbm_bytes": 16e9, "hbm_bytes_per_s": 819e9},
}
#: BF16 matmul peaks measured on these parts before (FLOP/s): the TPU v5e's in issue 49
#: (docs/tpu.md), which its MFU figures there are taken against; this run's own is compared
REFERENCE_MEASURED_BF16 = {"TPU v5 lite": 164e12}


def nominal_peaks(device_kind: str) -> tuple[str | None, dict | None]:
    """``(part, its NOMINAL_PEAKS row)`` for a JAX ``device_kind``, or ``(None, None)``; a
    GPU's PCIe part (other peaks) is none of them."""
    for name, peaks in NOMINAL_PEAKS.items():
        if name in device_kind and "PCIe" not in device_kind:
            return name, peaks
    return None, None


def peak_for(device_kind: str, measured: float | None) -> tuple[float | None, str]:
    """The peak MFU is taken against: the part's nominal dense BF16 peak
    (:data:`NOMINAL_PEAKS`), else the BF16 matrix-multiply peak the device section measured."""
    name, peaks = nominal_peaks(device_kind)
    if peaks:
        return peaks["bf16_flops"], f"nominal dense BF16 peak of {name} ({device_kind})"
    if measured:
        return measured, f"measured BF16 x BF16 -> FP32 matmul peak ({device_kind})"
    return None, "no peak known"


def log(message: str) -> None:
    print(f"[device-check {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def _clean(value):
    """JSON-safe: non-finite floats become strings ("nan", "inf") instead of invalid JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {str(k): _clean(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_clean(v) for v in value]
    return value


def write_json(path: Path, value: dict) -> None:
    """Atomically (a reader sees the previous version or this one, never half of one)."""
    from minifield import atomic

    atomic.write_json(path, _clean(value))


def count_params(tree) -> int:
    import jax

    return int(sum(math.prod(leaf.shape) for leaf in jax.tree_util.tree_leaves(tree)))


def installed(package: str) -> str | None:
    """The installed version of ``package`` (None: not installed)."""
    from importlib import metadata

    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def memory_bandwidth(n_bytes: int, rounds: int = 5) -> float:
    """Bytes/s of the default device's memory: an FP32 array of ``n_bytes`` read and written
    once (``x + 1``, the bytes moved counted twice), median of ``rounds`` after a warm-up."""
    import jax
    import jax.numpy as jnp

    x = jnp.zeros((n_bytes // 4,), jnp.float32)
    add = jax.jit(lambda a: a + 1.0)
    add(x).block_until_ready()
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        add(x).block_until_ready()
        times.append(time.perf_counter() - start)
    return 2 * x.size * 4 / statistics.median(times)
