"""A scanned LoRA run holds its frozen base stacked once (:func:`.stored_base.stacked`): the
step's compiled temporaries hold no copy of the base's blocks, and the run's bits are those of
the base held per layer (stacked by the step every step, as before this change).

Both compile, so both are in the slow tier.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_base_model import _prepare, make_inputs
from test_lora import lora_recipe

from minifield.data.packing import Rows
from minifield.hf import stored_base
from minifield.models.execution import Execution
from minifield.models.llama import LlamaConfig
from minifield.state.arrays import state_hash
from minifield.training import lora, optimizer

pytestmark = pytest.mark.slow

RANK, TARGETS = 16, ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
#: wide matrices, few tokens: one copy of the blocks outweighs everything else the step holds
SHAPE = dict(d_model=256, n_layers=4, n_heads=4, n_kv_heads=2, d_ff=1024, vocab_size=512)
T = 32


def _temp_bytes(cfg, base) -> int:
    settings = lora.LoraSettings(RANK, 2.0 * RANK, TARGETS, "float32")
    opt = optimizer.make_optimizer({}, 10)
    state = jax.eval_shape(lambda: lora.init_state(cfg, settings, opt, 0, np.zeros(32, np.uint8)))
    step = jax.jit(
        lora.make_train_step(cfg, settings, opt, optimizer.make_schedule({}, 10)),
        donate_argnums=(0,),
    )
    ints = jax.ShapeDtypeStruct((1, T), jnp.int32)
    batch = Rows(ints, ints, ints, jax.ShapeDtypeStruct((1, T), jnp.float32))
    return step.lower(state, base, batch).compile().memory_analysis().temp_size_in_bytes


def _bound(cfg) -> int:
    """What the step may hold beyond its arguments, by hand (FP32, 1 row of ``T`` tokens,
    remat full; ``minifield.models.device_memory``'s parts): each layer's input; one layer's
    working set ``T x 4 x (8 D + 4 F)`` and its attention's scores, probabilities and their
    gradients ``4 x H x T^2 x 4``; three ``[T, V]`` logits; the adapters' gradient, update and
    AdamW's new moments (4 copies of the adapters' 4-byte parameters); all doubled."""
    D, F, L, V, H = cfg.d_model, cfg.d_ff, cfg.n_layers, cfg.vocab_size, cfg.n_heads
    kv = cfg.n_kv_heads * cfg.head_dim
    pairs = [(D, H * cfg.head_dim), (D, kv), (D, kv), (H * cfg.head_dim, D), (D, F), (D, F), (F, D)]
    adapters = L * sum((n_in + n_out) * RANK for n_in, n_out in pairs)
    held = L * T * D * 4 + T * 4 * (8 * D + 4 * F) + 4 * H * T * T * 4 + 3 * T * V * 4
    return 2 * (held + 4 * adapters * 4)


def test_the_scanned_step_holds_no_copy_of_the_base_blocks():
    """FP32 products (XLA:CPU widens a BF16 base's whole stack for its products, a CPU-only
    copy; a TPU multiplies BF16 as held): the temporaries are within the hand bound, which is
    below one copy of the blocks; the same step given the base per layer (which it stacks)
    holds that copy."""
    how = Execution(scan_layers=True, remat="full")
    cfg = LlamaConfig(**SHAPE, max_len=T, tie_embeddings=True, execution=how)
    base = stored_base.zeros(cfg, "float32")  # an abstract FP32 base in its checkpoint's layout
    blocks = sum(math.prod(a.shape) * 4 for a in jax.tree_util.tree_leaves(base.params["blocks"]))
    bound = _bound(cfg)
    assert bound < blocks  # so a copy of the blocks cannot pass
    per_layer = _temp_bytes(cfg, base)
    stacked = _temp_bytes(cfg, jax.eval_shape(stored_base.stacked, base))
    assert stacked < bound
    assert per_layer >= blocks  # the test tells the two apart


def test_a_scanned_run_on_the_stacked_base_is_the_per_layer_runs_bits(tmp_path):
    """Three updates of a scanned LoRA program (its base stacked once as placed) against the
    same program given the base per layer as stored: equal state hashes, every array."""
    root = tmp_path / "in"
    make_inputs(root)
    loaded, (arrays, _) = _prepare(lora_recipe(root, scan_layers=True), root)
    program = loaded.strategy.build(loaded.data, arrays)
    twin = loaded.strategy.build(loaded.data, arrays)
    twin._base = stored_base.on_device(arrays, twin.lora.base_dtype)
    blocks_out_in = [
        [p for p in run._base.out_in if p.startswith("blocks/")] for run in (program, twin)
    ]
    assert "stacked" in program._base.params["blocks"] and not blocks_out_in[0]
    assert "00" in twin._base.params["blocks"] and blocks_out_in[1]  # transposed per step
    # the untied head too: transposed once as placed, against the twin's copy every step
    assert not program._base.out_in and "head/w" in twin._base.out_in
    states = []
    for run in (program, twin):
        state = run.place(run.init_state())
        for _ in range(3):
            state, _ = run.step(state)
        states.append(state)
    assert state_hash(states[0]) == state_hash(states[1])
    for a, b in zip(*(jax.tree_util.tree_leaves(s) for s in states), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    merged = [run._eval_params(s) for run, s in zip((program, twin), states, strict=True)]
    for a, b in zip(*(jax.tree_util.tree_leaves(m) for m in merged), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
