"""The linear-momentum teacher: y = 2x + 1, its 64 built-in examples and the held-out error
(the strategy and the program both use it; it imports no JAX)."""

from __future__ import annotations

import numpy as np

N_EXAMPLES = 64


def teacher_examples() -> dict[str, np.ndarray]:
    x = np.linspace(-1.0, 1.0, N_EXAMPLES, dtype=np.float32)
    return {"x": x, "y": (2.0 * x + 1.0).astype(np.float32)}


def heldout_mse(w: float, b: float, xs: list[float]) -> float:
    """Mean squared error against y = 2x + 1 on the held-out inputs (float64, on the host)."""
    x = np.asarray(xs, dtype=np.float64)
    return float(np.mean((w * x + b - (2.0 * x + 1.0)) ** 2))
