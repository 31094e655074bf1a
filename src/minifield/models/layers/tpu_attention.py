"""The chip's fused attention: splash attention (``jax.experimental.pallas.ops.tpu.
splash_attention``), what ``model.attention: pallas`` computes with ``runtime.backend: tpu``.

The same mathematics as :func:`.attention.xla_mix` over a packed row, without a ``[T, T]``
score matrix: splash walks key blocks with an online softmax and skips the blocks its static
mask rules out (above the diagonal; outside a sliding window); its backward pass is kernels
too (dq, then dk and dv). Matrix inputs are the compute dtype, accumulation and softmax FP32.

- Packed segments: the row's segment ids, for queries and keys alike (splash's
  ``SegmentIds``): a query reads keys of its own segment only.
- Causal masking: the static mask (``CausalMask``); with a sliding window ``w`` a
  ``LocalMask`` of ``w - 1`` keys back and none ahead, which is causal too. The window is
  counted in row slots; positions restart per segment and step by one, so within a segment
  that is :func:`.attention.window_mask`'s count in positions.
- Grouped-query attention without repeating keys and values: splash's MQA kernel (one
  key/value head, several query heads) runs once per key/value head, ``jax.vmap`` over the
  ``G`` groups and the batch; query head h reads key/value head h // (H / G).
- Soft-capping (Gemma 2): splash's ``attn_logits_soft_cap`` applies cap * tanh(s / cap) to the
  scaled scores before the mask, as the XLA path does.
- The score scale: splash computes plain q k^T, so the queries are multiplied by the scale
  first (in FP32, then the compute dtype: with a BF16 compute dtype the scaled queries are
  rounded once, where the XLA path scales the FP32 scores; exact where the scale is a power of
  two, head widths 16, 64, 256).

FP32 compute is refused on a TPU (``execution.splash_fp32_problem``: at check, and here):
splash's products ask for no precision, so there they are one BF16 pass, and the kernel
exposes no precision to ask for more. In Pallas's interpreter on CPU the products are FP32,
which is how the tests check the kernel's masking and blocking at FP32's rounding.

Block sizes: ``splash_table.splash_blocks``, by row length and head width (the chip's
measurements, ``benchmarks/splash_blocks.py``; splash's defaults where none). On a TPU the
kernel runs natively; on CPU in Pallas's interpreter (slow: for tests and the benchmark's
smoke run); other backends are refused.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu import splash_attention as splash

from .. import execution, splash_table
from .primitives import F32


def block_sizes(
    seq_len: int, blocks: dict | None = None, head_dim: int | None = None
) -> splash.BlockSizes:
    """Splash's ``BlockSizes`` for rows of ``seq_len`` tokens of heads ``head_dim`` wide
    (``splash_table.splash_blocks``; ``blocks`` overrides the table's sizes by field name)."""
    return splash.BlockSizes(**splash_table.splash_blocks(seq_len, blocks, head_dim))


@functools.lru_cache(maxsize=64)
def _kernel(heads: int, seq_len: int, window, cap, blocks: splash.BlockSizes, interpret: bool):
    """Splash's MQA kernel over ``heads`` query heads of rows of ``seq_len`` (its static mask
    is worked out in NumPy when it is made: made once per shape, by every layer and trace).

    Its mask tables are made concrete arrays even when it is first made inside a trace, so
    the next trace can use them (a traced table would leak out of the first)."""
    shape = (seq_len, seq_len)
    if window is None:
        causal = splash.CausalMask(shape)
    else:
        causal = splash.LocalMask(shape, window_size=(window - 1, 0), offset=0)
    with jax.ensure_compile_time_eval():
        return splash.make_splash_mqa_single_device(
            splash.MultiHeadMask([causal] * heads),
            block_sizes=blocks,
            attn_logits_soft_cap=cap,
            interpret=interpret,
        )


def _interpret() -> bool:
    """Native on a TPU, Pallas's interpreter on CPU; other backends are refused."""
    backend = jax.default_backend()
    if backend in ("tpu", "cpu"):
        return backend == "cpu"
    raise ValueError(
        "model.attention pallas with runtime.backend tpu: splash attention is a TPU kernel, "
        f"but the JAX backend is {backend!r}; run on a TPU host or set runtime.backend"
    )


def splash_mix(
    cfg,
    q_BxTxHxK,
    k_BxTxGxK,
    v_BxTxGxK,
    segments_BxT,
    window,
    *,
    scale,
    blocks=None,
    interpret=None,
):
    """Segment-restricted causal attention of a packed row by splash attention: ``[B, T, H*K]``.

    ``window``: a sliding window (None, or one no row reaches: the whole segment); ``scale``:
    the score scale (``attention.score_scale``); ``blocks``: block sizes by field name (the
    benchmark's sweep); ``interpret``: None picks by backend."""
    B, T, H, K = q_BxTxHxK.shape
    G = k_BxTxGxK.shape[2]
    problem = execution.pallas_seq_len_problem(T, "tpu")
    if problem:
        raise ValueError(problem)
    if window is not None and window >= T:
        window = None  # no row reaches past it: the causal mask, without a local one
    interpret = _interpret() if interpret is None else interpret
    # on a TPU the kernel's products (native or interpreted) are the chip's one BF16 pass, so
    # FP32 compute would not be FP32; the recipe is refused at check, this guards other callers
    if jax.default_backend() == "tpu":
        problem = execution.splash_fp32_problem(jnp.dtype(cfg.dtype).name, "tpu")
        if problem:
            raise ValueError(problem)
    kernel = _kernel(
        H // G, T, window, getattr(cfg, "attn_softcap", None), block_sizes(T, blocks, K), interpret
    )
    dtype = cfg.dtype
    # [B, T, H, K] -> [B, G, H/G, T, K]: query head h = g * (H/G) + r reads key/value head g
    scaled_BxTxHxK = (q_BxTxHxK.astype(F32) * scale).astype(dtype)
    q_BxGxRxTxK = scaled_BxTxHxK.reshape(B, T, G, H // G, K).transpose(0, 2, 3, 1, 4)
    k_BxGxTxK, v_BxGxTxK = (t.astype(dtype).transpose(0, 2, 1, 3) for t in (k_BxTxGxK, v_BxTxGxK))
    segments_BxT = segments_BxT.astype(jnp.int32)

    def row(q_GxRxTxK, k_GxTxK, v_GxTxK, segments_T):
        ids = splash.SegmentIds(q=segments_T, kv=segments_T)
        return jax.vmap(kernel, in_axes=(0, 0, 0, None))(q_GxRxTxK, k_GxTxK, v_GxTxK, ids)

    out_BxGxRxTxK = jax.vmap(row)(q_BxGxRxTxK, k_BxGxTxK, v_BxGxTxK, segments_BxT)
    return out_BxGxRxTxK.transpose(0, 3, 1, 2, 4).reshape(B, T, H * K).astype(dtype)
