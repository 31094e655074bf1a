"""The chip's fused attention (``model.attention: pallas`` with ``runtime.backend: tpu``):
splash attention against the XLA path (the reference), forward and gradients, with packed
segments, grouped-query heads, sliding windows and soft-capping; on CPU the kernel runs in
Pallas's interpreter, on a TPU natively (the same tests, the same bounds)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas.ops.tpu import splash_attention as splash

from minifield.data.packing import Rows
from minifield.models import execution, model
from minifield.models.execution import Execution
from minifield.models.layers import attention, tpu_attention
from minifield.models.llama import LlamaConfig

V = 37
ON_TPU = Execution(attention="pallas", backend="tpu")


def llama(**overrides):
    base = dict(vocab_size=V, d_model=16, n_layers=1, n_heads=4, n_kv_heads=2, d_ff=32)
    base.update(max_len=256, compute_dtype="float32")
    base.update(overrides)
    return LlamaConfig(**base)


def packed_rows(T):
    """Two rows: segments whose boundaries fall inside the 128-token blocks, a segment that
    crosses a block boundary, padding (segment 0) at the end of row 0; positions restart per
    segment."""
    lengths = [(T // 4 + 6, T // 2, T // 8), (T // 2 + 22,)]
    segments, positions = np.zeros((2, T), np.int32), np.zeros((2, T), np.int32)
    for b, row in enumerate(lengths):
        at = 0
        for s, n in enumerate(row, start=1):
            segments[b, at : at + n], positions[b, at : at + n] = s, np.arange(n)
            at += n
        segments[b, at:] = 0 if b == 0 else len(row) + 1
        positions[b, at:] = np.arange(T - at)
    return jnp.asarray(segments), jnp.asarray(positions)


def kernel_inputs(T, H, G, K=8, scale=1.0):
    keys = jax.random.split(jax.random.key(5), 4)
    q = scale * jax.random.normal(keys[0], (2, T, H, K), jnp.float32)
    k = scale * jax.random.normal(keys[1], (2, T, G, K), jnp.float32)
    v = jax.random.normal(keys[2], (2, T, G, K), jnp.float32)
    return q, k, v, jax.random.normal(keys[3], (2, T, H * K), jnp.float32)


def assert_splash_matches_xla(cfg, T, G, window=None, scale=1.0):
    """Outputs and the gradients of q, k, v (one random cotangent) within FP32 rounding."""
    q, k, v, cotangent = kernel_inputs(T, cfg.n_heads, G, scale=scale)
    segments, positions = packed_rows(T)
    mask = attention.window_mask(attention.segment_mask(segments), positions, positions, window)

    def xla(q, k, v):
        return attention.xla_mix(cfg, q, k, v, mask)

    def fused(q, k, v):
        scale = attention.score_scale(cfg, q.shape[3])
        return tpu_attention.splash_mix(cfg, q, k, v, segments, window, scale=scale)

    def out_and_grads(fn):
        def projected(q, k, v):  # <out, cotangent>: its gradients are the cotangent's vjp
            out = fn(q, k, v)
            return jnp.vdot(out, cotangent), out

        (_, out), grads = jax.value_and_grad(projected, (0, 1, 2), has_aux=True)(q, k, v)
        return out, grads

    (out_x, grads_x), (out_f, grads_f) = jax.jit(
        lambda: [out_and_grads(xla), out_and_grads(fused)]
    )()
    np.testing.assert_allclose(out_f, out_x, rtol=1e-5, atol=1e-5)
    for g_f, g_x in zip(grads_f, grads_x, strict=True):
        assert g_f.shape == g_x.shape  # k, v: [B, T, G, K], never repeated to H heads
        np.testing.assert_allclose(g_f, g_x, rtol=1e-5, atol=2e-5)


def test_splash_matches_the_xla_path_with_segments_gqa_window_and_soft_cap():
    """One block (128 tokens): segments, grouped-query heads, a 40-token window and a cap
    the scaled scores reach (inputs scaled by 3: scores up to ~30 against a cap of 5)."""
    cfg = llama(attn_softcap=5.0, max_len=128)
    assert_splash_matches_xla(cfg, T=128, G=2, window=40, scale=3.0)


@pytest.mark.slow  # 4-5 s each of compiling in the interpreter on this machine
@pytest.mark.parametrize(
    "heads, window, cap",
    [((4, 2), None, None), ((4, 1), 40, None), ((2, 2), 100, 5.0), ((4, 2), 300, None)],
    ids=["gqa-causal", "mqa-window", "mha-window-cap", "window-past-the-row"],
)
def test_splash_matches_the_xla_path_across_blocks(heads, window, cap):
    """Rows of two 128-token blocks: segments and windows cross block boundaries, so splash
    skips, fully computes and partly masks blocks."""
    H, G = heads
    cfg = llama(n_heads=H, n_kv_heads=G, attn_softcap=cap)
    assert_splash_matches_xla(cfg, T=256, G=G, window=window, scale=3.0 if cap else 1.0)


@pytest.mark.slow  # compiling in the interpreter, three times
def test_splash_in_bf16_is_within_the_xla_paths_own_bf16_noise():
    """BF16 compute against the FP32 XLA path: splash's error (output and each gradient, as
    a fraction of the reference's norm) at most 1.5 times the BF16 XLA path's own (measured
    here: 0.3-0.5 % for both, splash's at most 1.15 times). Head width 8: the score scale is
    not a power of two, so the queries scaled before the kernel are rounded."""
    f32 = llama(max_len=128)
    bf16 = dataclasses.replace(f32, compute_dtype="bfloat16")
    q, k, v, cotangent = kernel_inputs(128, 4, 2)
    segments, _ = packed_rows(128)
    mask = attention.segment_mask(segments)

    def out_and_grads(cfg, fused):
        def fn(q, k, v):
            if fused:
                scale = attention.score_scale(cfg, q.shape[3])
                return tpu_attention.splash_mix(cfg, q, k, v, segments, None, scale=scale)
            return attention.xla_mix(cfg, q, k, v, mask)

        out, vjp = jax.vjp(fn, q, k, v)
        return [out, *vjp(cotangent.astype(out.dtype))]

    reference, xla, splash_ = (
        jax.jit(lambda cfg=cfg, fused=fused: out_and_grads(cfg, fused))()
        for cfg, fused in ((f32, False), (bf16, False), (bf16, True))
    )
    for r, x, s in zip(reference, xla, splash_, strict=True):
        r, x, s = (np.asarray(a, np.float64) for a in (r, x, s))
        assert np.linalg.norm(s - r) <= 1.5 * np.linalg.norm(x - r)


@pytest.mark.slow  # ~10 s of compiling in the interpreter
def test_a_windowed_capped_model_computes_the_same_loss_and_gradients_through_splash():
    """The model's path: ``model.attention pallas`` on a TPU recipe reaches splash from the
    layer loop, each layer with its own window (``layer_types``), and computes the XLA path's
    loss and parameter gradients (FP32)."""
    cfg = llama(
        n_layers=2,
        attn_softcap=20.0,
        sliding_window=48,
        layer_types=("sliding_attention", "full_attention"),
        max_len=128,
    )
    params = model.init_params(cfg, jax.random.key(0))
    segments, positions = packed_rows(128)
    tokens = jax.random.randint(jax.random.key(1), (2, 128), 1, V)
    batch = Rows(tokens, segments, positions, loss_mask=jnp.ones((2, 128)))

    def loss_and_grads(cfg):
        return jax.jit(jax.value_and_grad(lambda p: model.loss_fn(p, cfg, batch)[0]))(params)

    loss_x, grads_x = loss_and_grads(cfg)
    loss_f, grads_f = loss_and_grads(dataclasses.replace(cfg, execution=ON_TPU))
    np.testing.assert_allclose(float(loss_f), float(loss_x), rtol=1e-6)
    for g_f, g_x in zip(jax.tree.leaves(grads_f), jax.tree.leaves(grads_x), strict=True):
        np.testing.assert_allclose(g_f, g_x, rtol=1e-4, atol=1e-6)


def test_the_block_table_starts_from_splash_defaults():
    defaults = splash.BlockSizes.get_default()
    assert execution.SPLASH_BLOCKS == {
        name: getattr(defaults, name) for name in execution.SPLASH_BLOCKS
    }


def test_blocks_are_fitted_to_the_row():
    """Each block: the largest multiple of 128 up to its size that divides the row; a compute
    block divides its block."""
    asked = {"block_q": 512, "block_kv": 512, "block_kv_compute": 256, "block_q_dkv": 1024}
    at_384 = execution.splash_blocks(384, asked)
    assert (at_384["block_q"], at_384["block_kv"], at_384["block_kv_compute"]) == (384, 384, 128)
    assert at_384["block_q_dkv"] == 384 and at_384["block_q_dq"] == 128
    at_2048 = execution.splash_blocks(2048, asked)
    assert (at_2048["block_q"], at_2048["block_kv_compute"], at_2048["block_q_dkv"]) == (
        512,
        256,
        1024,
    )
    assert tpu_attention.block_sizes(128) == splash.BlockSizes.get_default()


def test_rows_that_are_not_whole_lanes_are_refused():
    cfg = llama()
    q, kv = jnp.zeros((1, 96, 4, 8)), jnp.zeros((1, 96, 2, 8))
    with pytest.raises(ValueError, match=r"splash attention.*multiple of 128 \(got 96\)"):
        tpu_attention.splash_mix(cfg, q, kv, kv, jnp.ones((1, 96), jnp.int32), None, scale=1.0)


def test_splash_is_refused_on_a_gpu(monkeypatch):
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    q, kv = jnp.zeros((1, 128, 4, 8)), jnp.zeros((1, 128, 2, 8))
    with pytest.raises(ValueError, match=r"splash attention is a TPU kernel.*'gpu'"):
        ones = jnp.ones((1, 128), jnp.int32)
        tpu_attention.splash_mix(llama(), q, kv, kv, ones, None, scale=1.0)


def test_windows_and_soft_caps_keep_the_fused_kernel_on_a_tpu_only():
    """Gemma 2 and Mistral shapes: accepted with splash, refused by name with the GPU kernel."""
    cfg = llama(attn_softcap=50.0, sliding_window=64)
    dataclasses.replace(cfg, execution=ON_TPU)
    with pytest.raises(ValueError, match=r"no score soft-capping .*off a TPU") as caught:
        dataclasses.replace(cfg, execution=Execution(attention="pallas"))
    assert "sliding_window 64 < the rows' 256" in str(caught.value)
