"""The chip's fused attention (``model.attention: pallas`` with ``runtime.backend: tpu``):
splash attention against the XLA path (the reference), forward and gradients, with packed
segments, grouped-query heads, sliding windows and soft-capping.

On CPU the kernel runs in Pallas's interpreter, whose products are FP32: there FP32 compute
checks the kernel's masking and blocking at FP32's rounding, and BF16 compute is checked too.
On a TPU it runs natively in BF16 only: its products ask for no precision, so there FP32
compute would be one BF16 pass, and it is refused (at check and by the kernel's entry). A
BF16 check's bound is a property of BF16 arithmetic, the same on every backend: splash's
distance from the FP32 XLA path at most 1.5 times the BF16 XLA path's own."""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import REPO
from jax.experimental.pallas.ops.tpu import splash_attention as splash

from minifield.data.packing import Rows
from minifield.models import execution, model, splash_table
from minifield.models.execution import Execution
from minifield.models.layers import attention, tpu_attention
from minifield.models.llama import LlamaConfig

V = 37
ON_TPU = Execution(attention="pallas", backend="tpu")
ON_CHIP = jax.default_backend() == "tpu"
HIGHEST = jax.lax.Precision.HIGHEST
#: the compute dtypes splash is checked in: FP32 in the interpreter on CPU only (refused on a
#: TPU); BF16 everywhere (slow on CPU: another compile in the interpreter)
DTYPES = ["bfloat16"] if ON_CHIP else ["float32", pytest.param("bfloat16", marks=pytest.mark.slow)]


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


def assert_within_bf16_noise(reference, xla, fused):
    """BF16 compute against the FP32 XLA path (``reference``): the fused path's distance (as
    a norm over the array) at most 1.5 times the BF16 XLA path's own (measured on CPU, where
    the XLA path's is 0.3-1 % of the reference's norm: splash's 0.78 to 1.41 times it, the
    most v's gradient with two heads, a window and a cap; the model's gradients 1.31)."""
    for r, x, f in zip(reference, xla, fused, strict=True):
        r, x, f = (np.asarray(a, np.float64) for a in (r, x, f))
        assert np.linalg.norm(f - r) <= 1.5 * np.linalg.norm(x - r)


def assert_splash_matches_xla(cfg, T, G, window=None, scale=1.0):
    """Outputs and the gradients of q, k, v (one random cotangent): within FP32 rounding of
    the XLA path's with FP32 compute (in the interpreter), within BF16 noise
    (:func:`assert_within_bf16_noise`) with BF16 compute. Head width 8: the score scale is not
    a power of two, so in BF16 the queries scaled before the kernel are rounded."""
    q, k, v, cotangent = kernel_inputs(T, cfg.n_heads, G, scale=scale)
    segments, positions = packed_rows(T)
    mask = attention.window_mask(attention.segment_mask(segments), positions, positions, window)

    def xla(cfg, q, k, v):
        return attention.xla_mix(cfg, q, k, v, mask)

    def fused(cfg, q, k, v):
        scale = attention.score_scale(cfg, q.shape[3])
        return tpu_attention.splash_mix(cfg, q, k, v, segments, window, scale=scale)

    def out_and_grads(fn, cfg):
        def projected(q, k, v):  # <out, cotangent>: its gradients are the cotangent's vjp
            out = fn(cfg, q, k, v)
            # HIGHEST: at a TPU's default the product's transpose would round the cotangent
            # to BF16 (one pass)
            product = jnp.vdot(out.astype(jnp.float32), cotangent, precision=HIGHEST)
            return product, out

        (_, out), grads = jax.value_and_grad(projected, (0, 1, 2), has_aux=True)(q, k, v)
        return [out, *grads]

    if cfg.compute_dtype == "float32":
        out_x, *grads_x = jax.jit(lambda: out_and_grads(xla, cfg))()
        out_f, *grads_f = jax.jit(lambda: out_and_grads(fused, cfg))()
        np.testing.assert_allclose(out_f, out_x, rtol=1e-5, atol=1e-5)
        for g_f, g_x in zip(grads_f, grads_x, strict=True):
            assert g_f.shape == g_x.shape  # k, v: [B, T, G, K], never repeated to H heads
            np.testing.assert_allclose(g_f, g_x, rtol=1e-5, atol=2e-5)
        return
    f32 = dataclasses.replace(cfg, compute_dtype="float32")
    reference = jax.jit(lambda: out_and_grads(xla, f32))()
    bf16_xla, bf16_fused = (jax.jit(lambda fn=fn: out_and_grads(fn, cfg))() for fn in (xla, fused))
    for g_f, g_x in zip(bf16_fused[1:], reference[1:], strict=True):
        assert g_f.shape == g_x.shape
    assert_within_bf16_noise(reference, bf16_xla, bf16_fused)


@pytest.mark.parametrize("dtype", DTYPES)
def test_splash_matches_the_xla_path_with_segments_gqa_window_and_soft_cap(dtype):
    """One block (128 tokens): segments, grouped-query heads, a 40-token window and a cap
    the scaled scores reach (inputs scaled by 3: scores up to ~30 against a cap of 5)."""
    cfg = llama(attn_softcap=5.0, max_len=128, compute_dtype=dtype)
    assert_splash_matches_xla(cfg, T=128, G=2, window=40, scale=3.0)


@pytest.mark.slow  # 4-5 s each of compiling in the interpreter on this machine
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "heads, window, cap",
    [((4, 2), None, None), ((4, 1), 40, None), ((2, 2), 100, 5.0), ((4, 2), 300, None)],
    ids=["gqa-causal", "mqa-window", "mha-window-cap", "window-past-the-row"],
)
def test_splash_matches_the_xla_path_across_blocks(heads, window, cap, dtype):
    """Rows of two 128-token blocks: segments and windows cross block boundaries, so splash
    skips, fully computes and partly masks blocks."""
    H, G = heads
    cfg = llama(n_heads=H, n_kv_heads=G, attn_softcap=cap, compute_dtype=dtype)
    assert_splash_matches_xla(cfg, T=256, G=G, window=window, scale=3.0 if cap else 1.0)


def test_fp32_splash_is_refused_on_a_tpu(monkeypatch):
    """On a TPU the kernel's products are one BF16 pass (they ask for no precision), so FP32
    compute is refused by name, as at check (tests/test_tpu_defaults.py); natively on the
    chip, and on CPU as if it were one."""
    monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
    q, kv = jnp.zeros((1, 128, 4, 8)), jnp.zeros((1, 128, 2, 8))
    with pytest.raises(ValueError, match=r"does not compute .*float32.*use model.attention xla"):
        ones = jnp.ones((1, 128), jnp.int32)
        tpu_attention.splash_mix(llama(), q, kv, kv, ones, None, scale=1.0)


@pytest.mark.slow  # ~10 s of compiling in the interpreter
@pytest.mark.parametrize("dtype", DTYPES)
def test_a_windowed_capped_model_computes_the_same_loss_and_gradients_through_splash(dtype):
    """The model's path: ``model.attention pallas`` on a TPU recipe reaches splash from the
    layer loop, each layer with its own window (``layer_types``), and computes the XLA path's
    loss and parameter gradients: within FP32 rounding (FP32, in the interpreter), within the
    BF16 XLA path's own distance from the FP32 one (BF16; the gradients as one vector)."""
    cfg = llama(
        n_layers=2,
        attn_softcap=20.0,
        sliding_window=48,
        layer_types=("sliding_attention", "full_attention"),
        max_len=128,
        compute_dtype=dtype,
    )
    params = model.init_params(cfg, jax.random.key(0))
    segments, positions = packed_rows(128)
    tokens = jax.random.randint(jax.random.key(1), (2, 128), 1, V)
    batch = Rows(tokens, segments, positions, loss_mask=jnp.ones((2, 128)))

    def loss_and_grads(cfg):
        return jax.jit(jax.value_and_grad(lambda p: model.loss_fn(p, cfg, batch)[0]))(params)

    loss_x, grads_x = loss_and_grads(cfg)
    loss_f, grads_f = loss_and_grads(dataclasses.replace(cfg, execution=ON_TPU))
    if dtype == "bfloat16":
        loss_r, grads_r = loss_and_grads(dataclasses.replace(cfg, compute_dtype="float32"))

        def flat(grads):
            return np.concatenate([np.ravel(g) for g in jax.tree.leaves(grads)])

        assert_within_bf16_noise([flat(grads_r)], [flat(grads_x)], [flat(grads_f)])
        # the loss: one number, whose BF16 distance may vanish by chance; BF16's rounding
        # (2^-8 of it) bounds both paths' distance instead
        for loss in (loss_x, loss_f):
            assert abs(float(loss) - float(loss_r)) <= 2**-8 * abs(float(loss_r))
        return
    np.testing.assert_allclose(float(loss_f), float(loss_x), rtol=1e-6)
    for g_f, g_x in zip(jax.tree.leaves(grads_f), jax.tree.leaves(grads_x), strict=True):
        np.testing.assert_allclose(g_f, g_x, rtol=1e-4, atol=1e-6)


def test_the_table_falls_back_to_splash_defaults():
    defaults = splash.BlockSizes.get_default()
    assert splash_table.SPLASH_DEFAULT_BLOCKS == {
        name: getattr(defaults, name) for name in splash_table.SPLASH_DEFAULT_BLOCKS
    }
    for widths in splash_table.SPLASH_BLOCKS.values():
        for sizes in widths.values():
            assert set(sizes) == set(splash_table.SPLASH_DEFAULT_BLOCKS)


def test_the_table_is_looked_up_by_head_width_and_the_longest_measured_row_not_above():
    table = {
        1024: {64: dict.fromkeys(splash_table.SPLASH_DEFAULT_BLOCKS, 256)},
        4096: {64: dict.fromkeys(splash_table.SPLASH_DEFAULT_BLOCKS, 1024)},
    }
    lookup = splash_table.splash_table_blocks
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(splash_table, "SPLASH_BLOCKS", table)
        assert lookup(512, 64) == splash_table.SPLASH_DEFAULT_BLOCKS  # below every measurement
        assert set(lookup(1024, 64).values()) == {256}
        assert set(lookup(2048, 64).values()) == {256}  # 1024's, the nearest not above
        assert set(lookup(8192, 64).values()) == {1024}
        assert lookup(4096, 128) == splash_table.SPLASH_DEFAULT_BLOCKS  # a width not measured
        assert lookup(4096, None) == splash_table.SPLASH_DEFAULT_BLOCKS
        # then fitted to the row: 1024 does not divide 4608 = 6 * 768
        assert set(splash_table.splash_blocks(4608, head_dim=64).values()) == {768}


def test_the_shipped_table_is_the_chips_sweep():
    """``SPLASH_BLOCKS`` is the ``best`` of the sweep recorded from the chip
    (``docs/splash-blocks.json``, benchmarks/splash_blocks.py's output): every complete shape,
    nothing else; each entry the joined blocks where their step beat all 512, else all 512."""
    recorded = json.loads((REPO / "docs" / "splash-blocks.json").read_text())
    assert (
        recorded["device"].startswith("TPU") and recorded["format"] == "minifield-splash-blocks/1"
    )
    complete = {(s["seq_len"], s["head_dim"]) for s in recorded["shapes"] if s.get("complete")}
    shipped = {(T, K): b for T, w in splash_table.SPLASH_BLOCKS.items() for K, b in w.items()}
    assert set(shipped) == complete
    for shape in recorded["shapes"]:
        if not shape.get("complete"):
            continue
        blocks = shipped[shape["seq_len"], shape["head_dim"]]
        assert blocks == recorded["best"][str(shape["seq_len"])][str(shape["head_dim"])]
        joined, held = shape["joined"], shape["baseline"]["step"]
        faster = joined["blocks"] if "ms" in joined and joined["ms"] < held else shape["held"]
        assert blocks == faster
    # a head width the sweep did not measure gets splash's own defaults
    assert splash_table.splash_blocks(512, head_dim=96) == splash_table.SPLASH_DEFAULT_BLOCKS


def test_blocks_are_fitted_to_the_row():
    """Each block: the largest multiple of 128 up to its size that divides the row; a compute
    block divides its block."""
    asked = {"block_q": 512, "block_kv": 512, "block_kv_compute": 256, "block_q_dkv": 1024}
    at_384 = splash_table.splash_blocks(384, asked)
    assert (at_384["block_q"], at_384["block_kv"], at_384["block_kv_compute"]) == (384, 384, 128)
    assert at_384["block_q_dkv"] == 384 and at_384["block_q_dq"] == 128
    at_2048 = splash_table.splash_blocks(2048, asked)
    assert (at_2048["block_q"], at_2048["block_kv_compute"], at_2048["block_q_dkv"]) == (
        512,
        256,
        1024,
    )
    assert tpu_attention.block_sizes(128) == splash.BlockSizes.get_default()


def test_the_kernel_and_its_blocks_for_the_compiled_event():
    assert execution.attention_kernel(Execution(), 2048, 64) == {"kernel": "xla"}
    on_tpu = execution.attention_kernel(ON_TPU, 2048, 64)
    assert on_tpu == {"kernel": "splash", "blocks": splash_table.splash_blocks(2048, head_dim=64)}
    on_gpu = execution.attention_kernel(Execution(attention="pallas", backend="gpu"), 64, 64)
    assert on_gpu == {"kernel": "mha", "blocks": {"forward": 64, "backward": 32}}


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
