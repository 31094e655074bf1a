"""What each ``training.remat`` policy keeps, read from the compiled update's memory (its
``memory_analysis()``, nothing run): the temporaries of a scanned Llama model's loss and
gradients (layers scanned, as the device check's step runs them: a scan keeps each layer's
residuals as stacked buffers, so they show), ``none`` > ``dots_saveable`` >
``save_attention`` > ``full``, and ``save_attention`` above ``full`` by exactly what it keeps,
counted by hand. That they compute the same loss and gradients: ``tests/test_execution.py``."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from minifield.data.packing import Rows
from minifield.models import model
from minifield.models.execution import Execution
from minifield.models.llama import LlamaConfig

B, T, L, D, H, G = 4, 128, 4, 64, 4, 2


def temp_bytes(remat: str) -> int:
    """The compiled program's temporaries, against abstract shapes."""
    cfg = LlamaConfig(
        vocab_size=64, d_model=D, n_layers=L, n_heads=H, n_kv_heads=G, d_ff=128, max_len=T,
        compute_dtype="float32", execution=Execution(remat=remat, scan_layers=True),
    )  # fmt: skip
    params = jax.eval_shape(lambda: model.init_params(cfg, jax.random.key(0)))
    ones = np.ones((B, T), np.int32)
    positions = np.tile(np.arange(T, dtype=np.int32), (B, 1))
    batch = jax.tree_util.tree_map(jnp.asarray, Rows(ones, ones, positions, ones * 1.0))
    step = jax.value_and_grad(lambda p: model.loss_fn(p, cfg, batch)[0])
    return jax.jit(step).lower(params).compile().memory_analysis().temp_size_in_bytes


@pytest.mark.slow  # three compiles of a scanned model (3.8 s of the 3.12 fast tier)
def test_save_attention_keeps_its_names_between_none_and_full():
    sizes = {remat: temp_bytes(remat) for remat in ("none", "save_attention", "full")}
    assert sizes["none"] > sizes["save_attention"] > sizes["full"]
    # every layer's rotated q [B, T, H, K], k and v [B, T, G, K] and output [B, T, H*K], FP32
    K = D // H
    kept = L * B * T * (H * K + 2 * G * K + H * K) * 4
    assert abs(sizes["save_attention"] - sizes["full"] - kept) <= 1024, (sizes, kept)


@pytest.mark.slow  # two more compiles (4 s on 2 cores)
def test_dots_saveable_keeps_more_and_offloading_no_more_on_the_device():
    sizes = {r: temp_bytes(r) for r in ("none", "dots_saveable", "save_attention")}
    assert sizes["none"] > sizes["dots_saveable"] > sizes["save_attention"]
    # on CPU the host is the device's memory: offloading moves nothing (on a TPU it does)
    assert temp_bytes("offload_attention") <= sizes["save_attention"]
