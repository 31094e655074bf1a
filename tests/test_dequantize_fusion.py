"""Where the quantized base's matrices are made back (``quantize.dequantize`` inside
``primitives.linear``): read from the optimized HLO by ``benchmarks/qlora_step.py``'s
:func:`materialised`, which the benchmark prints for each mode on the chip.

XLA:CPU runs a product as its own kernel, which takes no fused producers: there the made-back
matrix is written once, in BF16, by one fusion that reads the packed codes and the scales (no
FP32 matrix, no gather of the NF4 table, no transposed copy). Whether the TPU's XLA fuses
it into the product's operand is what the benchmark's count says there (docs/quantized-base.md)."""

from __future__ import annotations

import math
import re
import sys
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import REPO

from minifield.models import execution, quantize
from minifield.models.layers import primitives

sys.path.insert(0, str(REPO / "benchmarks"))
try:
    import qlora_step
finally:
    sys.path.remove(str(REPO / "benchmarks"))

K, N, RANK, LAYERS = 256, 384, 16, 2
TRANSPOSE = re.compile(r"= \w+\[([\d,]*)\]\S* transpose\(")
CFG = SimpleNamespace(
    compute_dtype="bfloat16", dtype=jnp.bfloat16, execution=execution.Execution()
)  # XLA's product: the formulation this file is about


def step_hlo(scheme: str) -> str:
    """The optimized HLO of a LoRA loss and its gradients through two layers of one quantized
    matrix each, scanned and rematerialised as a training step's (``scan_layers``, ``remat:
    full``), the base an argument (a closed-over one would be folded at compile time)."""
    rng = np.random.default_rng(0)
    layers = [
        quantize.quantize(
            jnp.asarray(rng.standard_normal((K, N)), jnp.float32), scheme, double=True
        )
        for _ in range(LAYERS)
    ]
    base = jax.tree.map(lambda *leaves: jnp.stack(leaves), *layers).held_in("bfloat16")

    @jax.checkpoint
    def layer(x, weights):
        base, a, b = weights
        y = primitives.linear(CFG, x, primitives.LoraWeight(base, a, b, 2.0))
        return y[..., :K].astype(jnp.bfloat16), None

    def loss(x, a, b, base):
        return jax.lax.scan(layer, x, (base, a, b))[0].astype(jnp.float32).sum()

    x = jnp.ones((2, 8, K), jnp.bfloat16)
    a, b = jnp.ones((LAYERS, K, RANK)), jnp.ones((LAYERS, RANK, N))
    grad = jax.value_and_grad(loss, argnums=(0, 1, 2))
    return jax.jit(grad).lower(x, a, b, base).compile().as_text()


@pytest.mark.slow  # two compilations of 4 s
@pytest.mark.parametrize("scheme", quantize.SCHEMES)
def test_the_cpu_writes_the_made_back_matrix_in_bf16_only_from_the_codes(scheme):
    """Once in the forward layer loop and once in the backward one, as the BF16 operand of
    the products; no FP32 matrix (the NF4 table's constants broadcast and hoisted out of the
    loop were 16 of them), no gather, no transposed copy."""
    hlo = step_hlo(scheme)
    assert " gather(" not in hlo
    transposed = [math.prod(int(d) for d in dims.split(",")) for dims in TRANSPOSE.findall(hlo)]
    assert all(size < K * N // 2 for size in transposed)  # the adapters' small ones only
    loops = 2  # the forward layer loop and the backward one
    assert qlora_step.materialised(hlo, [(K, N)]) == [f"bf16[{K},{N}] fusion"] * loops


HLO = """\
%fused_computation (param_0: u8[4,6]) -> bf16[8,6] {
  %param_0 = u8[4,6]{1,0} parameter(0)
  ROOT %convert = bf16[8,6]{1,0} convert(%param_0)
}

%fused_dot (p0: bf16[2,8], p1: bf16[8,6]) -> f32[2,6] {
  %made = f32[4,2,6]{2,1,0} broadcast(%p1), dimensions={}
  ROOT %dot = f32[2,6]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

ENTRY %main.4 (x: bf16[2,8], codes: u8[4,6], w: bf16[6,8]) -> f32[2,6] {
  %w = bf16[6,8]{1,0} parameter(2)
  %view = bf16[8,6]{0,1} bitcast(%w)
  %made = bf16[8,6]{1,0} fusion(%codes), kind=kLoop, calls=%fused_computation
  %pair = (f32[2,6]{1,0}, f32[4,2,6]{2,1,0:T(8,128)}) fusion(%x, %made), kind=kOutput, calls=%fused_dot
  %other = f32[8,5]{1,0} copy(%x)
  ROOT %dot = f32[2,6]{1,0} dot(%x, %made), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}
"""


def test_materialised_counts_what_is_written_outside_fusions():
    """Arrays of an [8, 6] matrix: the fusion's BF16 output and a multi-output fusion's
    ``[in / 2, 2, out]`` element, not a parameter, a bitcast, a fused computation's own
    arrays, nor another shape."""
    assert qlora_step.materialised(HLO, [(8, 6)]) == ["bf16[8,6] fusion", "f32[4,2,6] fusion"]
