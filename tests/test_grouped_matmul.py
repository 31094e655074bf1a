"""The experts' grouped matrix product against a float64 NumPy loop over the groups (each
group's rows times its own matrix), values and gradients: empty groups, groups longer than a
tile and with a tail, rows past the groups, BF16 rounding. Both products: the tiles of
``models/layers/grouped.py`` (CPU, GPU) and ``jax.lax.ragged_dot`` of
``models/layers/tpu_grouped.py`` (a TPU recipe), which runs on CPU too; and the one that
``grouped.matmul`` picks for each backend."""

from __future__ import annotations

from types import SimpleNamespace

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from minifield.models.execution import Execution
from minifield.models.layers import grouped, tpu_grouped

K, N = 8, 12
#: an empty group first and in the middle, one of exactly a tile, one of a tile and a tail of
#: one row, one shorter than a tail; 5 rows after the last group belong to none
SIZES = [0, grouped.TILE, 3, 0, grouped.TILE + 1, grouped.TAIL + 5]
EXTRA = 5


def reference(x, w, dy, sizes):
    """``y``, ``dL/dx``, ``dL/dw`` of ``L = sum(y * dy)`` in float64, group by group."""
    x, w, dy = (np.asarray(a, np.float64) for a in (x, w, dy))
    y, dx, dw = np.zeros_like(dy), np.zeros_like(x), np.zeros_like(w)
    start = 0
    for g, n in enumerate(sizes):
        rows = slice(start, start + n)
        y[rows] = x[rows] @ w[g]
        dx[rows] = dy[rows] @ w[g].T
        dw[g] = x[rows].T @ dy[rows]
        start += n
    return y, dx, dw


def arrays(seed=0):
    rng = np.random.default_rng(seed)
    M = sum(SIZES) + EXTRA
    x = rng.standard_normal((M, K)).astype(np.float32)
    w = rng.standard_normal((len(SIZES), K, N)).astype(np.float32)
    dy = rng.standard_normal((M, N)).astype(np.float32)
    return x, w, dy


#: the products under test, by ``execution.grouped_kernel``'s names (``gmm``: megablox's
#: kernel in Pallas's interpreter, BF16 only)
PRODUCTS = {
    "tiles": grouped.tiled,
    "ragged_dot": tpu_grouped.matmul,
    "gmm": lambda *args: tpu_grouped.matmul(*args, kernel="gmm"),
    "ragged_tgmm": lambda *args: tpu_grouped.matmul(*args, kernel="ragged_tgmm"),
}
FP32_PRODUCTS = ("tiles", "ragged_dot")


def ours(dtype, x, w, dy, product="tiles", sizes=SIZES):
    sizes = jnp.asarray(sizes, jnp.int32)

    def loss(x, w):
        y = PRODUCTS[product](dtype, x, w, sizes)
        return jnp.sum(y * dy), y

    (_, y), (dx, dw) = jax.jit(jax.value_and_grad(loss, (0, 1), has_aux=True))(x, w)
    return y, dx, dw


def bf16(a):
    return np.asarray(a).astype(ml_dtypes.bfloat16).astype(np.float32)


@pytest.mark.parametrize("product", FP32_PRODUCTS)
def test_fp32_values_and_gradients_equal_the_group_loop(product):
    x, w, dy = arrays()
    y, dx, dw = ours("float32", jnp.asarray(x), jnp.asarray(w), dy, product)
    for got, expected in zip((y, dx, dw), reference(x, w, dy, SIZES), strict=True):
        np.testing.assert_allclose(np.asarray(got), expected, rtol=1e-5, atol=1e-5)
    assert not np.asarray(y)[sum(SIZES) :].any()  # rows of no group are 0
    assert not np.asarray(dw)[0].any() and not np.asarray(dw)[3].any()  # empty groups


# gmm with FP32 masters and ragged_tgmm in the slow tier (Pallas's interpreter; the fast tier
# keeps gmm with BF16, and ragged_tgmm against the tiles below)
@pytest.mark.parametrize(
    ("w_dtype", "product"),
    [
        pytest.param(
            w_dtype,
            product,
            marks=pytest.mark.slow
            if (w_dtype, product) == (jnp.float32, "gmm") or product == "ragged_tgmm"
            else (),
        )
        for w_dtype in (jnp.float32, jnp.bfloat16)
        for product in PRODUCTS
    ],
)
def test_bf16_rounds_the_operands_and_keeps_the_gradients_dtypes(w_dtype, product):
    """BF16 x BF16 products with FP32 sums, forward and backward (the output gradient rounded
    to BF16 too); the matrices' gradient in their own dtype (FP32 masters: unrounded)."""
    x, w, dy = arrays(1)
    x16, w_in = jnp.asarray(x, jnp.bfloat16), jnp.asarray(w, w_dtype)
    y, dx, dw = ours("bfloat16", x16, w_in, dy, product)
    expected = reference(bf16(x), bf16(w), bf16(dy), SIZES)
    assert (y.dtype, dx.dtype, dw.dtype) == (jnp.float32, jnp.bfloat16, w_dtype)
    np.testing.assert_allclose(np.asarray(y), expected[0], rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(np.asarray(dx, np.float32), bf16(expected[1]), rtol=1e-2, atol=2e-2)
    if w_dtype == jnp.float32:
        np.testing.assert_allclose(np.asarray(dw), expected[2], rtol=1e-5, atol=1e-4)
    else:
        np.testing.assert_allclose(
            np.asarray(dw, np.float32), bf16(expected[2]), rtol=1e-2, atol=5e-2
        )


@pytest.mark.parametrize(
    ("dtype", "kernel"),
    [
        ("float32", "ragged_dot"),
        ("bfloat16", "ragged_dot"),
        ("bfloat16", "gmm"),
        ("bfloat16", "ragged_tgmm"),
    ],  # fmt: skip
)
def test_the_tpu_products_equal_the_tiles(dtype, kernel):
    """The TPU's products and the CPU's agree on every value and gradient, FP32 and BF16, on
    uneven groups (a tile and one row, empty ones, one of many tiles); all sum the same
    BF16-rounded products in FP32, so within FP32 summation order."""
    sizes = [1, 0, 3 * grouped.TILE + 7, 0, grouped.TILE + 1, 2]
    rng = np.random.default_rng(2)
    M = sum(sizes) + EXTRA
    x, dy = rng.standard_normal((M, K)), rng.standard_normal((M, N))
    w = rng.standard_normal((len(sizes), K, N))
    x, w = jnp.asarray(x, dtype), jnp.asarray(w, jnp.float32)
    tiles = ours(dtype, x, w, dy.astype(np.float32), "tiles", sizes)
    ragged = ours(dtype, x, w, dy.astype(np.float32), kernel, sizes)
    for a, b in zip(tiles, ragged, strict=True):
        assert a.dtype == b.dtype
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-5 if dtype == "float32" else 2e-2)
    # empty groups' matrix gradients exactly 0 (Pallas's interpreter leaves what a kernel
    # never writes NaN: megablox's tgmm writes them, and nothing after it does)
    assert not np.asarray(ragged[2])[[1, 3]].any()
    expected = reference(x.astype(jnp.float32), w, dy, sizes)
    if dtype == "float32":  # and both the float64 loop's, gradients included
        for got, want in zip(ragged, expected, strict=True):
            np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("backend", "product"), [("tpu", "ragged_dot"), ("cpu", "tiles")])
def test_the_recipe_backend_picks_the_product(backend, product, monkeypatch):
    """``grouped.matmul`` runs ``ragged_dot`` for a TPU recipe, the tiles for any other."""
    called = []
    real_tiled, real_tpu = grouped.tiled, tpu_grouped.matmul
    monkeypatch.setattr(grouped, "tiled", lambda *a: called.append("tiles") or real_tiled(*a))
    monkeypatch.setattr(tpu_grouped, "matmul", lambda *a: called.append(a[-1]) or real_tpu(*a))
    cfg = SimpleNamespace(compute_dtype="float32", execution=Execution(backend=backend))
    x, w, _ = arrays()
    grouped.matmul(cfg, jnp.asarray(x), jnp.asarray(w), jnp.asarray(SIZES))
    assert called == [product]


def test_gmm_refuses_fp32_and_an_unknown_kernel():
    """megablox's kernel asks its products for no precision: FP32 compute is refused, not
    run at the TPU's one-pass BF16 default."""
    x, w, _ = arrays()
    sizes = jnp.asarray(SIZES, jnp.int32)
    for kernel in ("gmm", "ragged_tgmm"):
        with pytest.raises(ValueError, match=f"{kernel}: its products ask for no precision"):
            tpu_grouped.matmul("float32", jnp.asarray(x), jnp.asarray(w), sizes, kernel)
    with pytest.raises(ValueError, match="expected a kernel of"):
        tpu_grouped.matmul("bfloat16", jnp.asarray(x), jnp.asarray(w), sizes, "tiles")
