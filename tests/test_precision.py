"""FP32 means FP32 on every backend: every matrix product of an FP32 computation, forward and
backward, asks for ``Precision.HIGHEST`` (a TPU's default is one BF16 pass, a GPU's TF32);
every BF16 product accumulates in FP32. A CPU computes FP32 products in FP32 whatever it is
asked, so what is checked here is what the programs ask for, read from their jaxprs; the
numbers on a chip are docs/tpu.md's."""

from __future__ import annotations

from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from minifield.models import moe
from minifield.models.execution import Execution
from minifield.models.layers import grouped
from minifield.models.layers.primitives import einsum

HIGHEST = jax.lax.Precision.HIGHEST


def dots(fn, *args) -> list:
    """Every ``dot_general`` (and ``ragged_dot_general``) equation of ``fn``'s forward and
    backward, nested ones included."""
    found = []

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name in ("dot_general", "ragged_dot_general"):
                found.append(eqn)
            for value in eqn.params.values():
                for sub in value if isinstance(value, (list, tuple)) else [value]:
                    inner = getattr(sub, "jaxpr", sub)
                    if hasattr(inner, "eqns"):
                        walk(inner)

    def loss(*xs):
        return jnp.sum(fn(*xs).astype(jnp.float32) ** 2)

    walk(jax.make_jaxpr(jax.value_and_grad(loss, range(len(args))))(*args).jaxpr)
    return found


def asks_highest(eqn) -> bool:
    precision = eqn.params["precision"]
    return precision is not None and all(p == HIGHEST for p in precision)


def operands(shape_a, shape_b):
    rng = np.random.default_rng(0)
    return (
        jnp.asarray(rng.standard_normal(shape_a), jnp.float32),
        jnp.asarray(rng.standard_normal(shape_b), jnp.float32),
    )


@pytest.mark.parametrize("compute_dtype", ["float32", "bfloat16"])
def test_the_model_product_says_its_precision(compute_dtype):
    cfg = SimpleNamespace(compute_dtype=compute_dtype, dtype=jnp.float32)
    found = dots(lambda a, b: einsum(cfg, "btk,kn->btn", a, b), *operands((2, 3, 8), (8, 5)))
    assert len(found) == 3  # the forward and both operands' gradients
    for eqn in found:
        if compute_dtype == "float32":
            assert asks_highest(eqn), eqn
        else:
            assert {v.aval.dtype for v in eqn.invars} == {jnp.dtype(jnp.bfloat16)}
            assert eqn.params["preferred_element_type"] == jnp.float32


@pytest.mark.parametrize("compute_dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize(("backend", "count"), [("cpu", 6), ("tpu", 3)])
def test_the_experts_grouped_product_says_its_precision(compute_dtype, backend, count):
    """The tiles (CPU): forward and both gradients, in the loop over tiles and over tails;
    ``ragged_dot`` (a TPU recipe): forward and both gradients."""
    cfg = SimpleNamespace(compute_dtype=compute_dtype, execution=Execution(backend=backend))
    sizes = jnp.asarray([grouped.TILE, 3], jnp.int32)
    x, w = operands((grouped.TILE + 3, 8), (2, 8, 5))
    found = dots(lambda x, w: grouped.matmul(cfg, x, w, sizes), x, w)
    assert len(found) == count
    for eqn in found:
        if compute_dtype == "bfloat16":
            assert {v.aval.dtype for v in eqn.invars[:2]} == {jnp.dtype(jnp.bfloat16)}
        assert eqn.params["preferred_element_type"] == jnp.float32
        assert asks_highest(eqn) == (compute_dtype == "float32"), eqn


def test_the_router_balance_loss_multiplies_its_fp32_probabilities_in_full():
    """The mean probability per expert, forward and its gradient, asks for HIGHEST; the
    one-hot share per expert (values 0 and 1, exact in any precision) has no gradient."""
    rng = np.random.default_rng(0)
    cfg = SimpleNamespace(experts_per_token=2)
    logits = jnp.asarray(rng.standard_normal((1, 6, 4)), jnp.float32)
    found = dots(lambda logits: moe.load_balancing_loss(cfg, logits), logits)
    assert len(found) == 3
    assert sum(asks_highest(eqn) for eqn in found) == 2
