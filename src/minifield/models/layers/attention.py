"""Segment-restricted causal attention over packed rows: the XLA path and a fused kernel.

Both paths compute, for every query head h, softmax(q k^T / sqrt(K)) v over the keys at or
before the query in the query's own segment (:func:`segment_mask`), with grouped-query
attention (query head h reads key/value head h // (H / G)):

- ``xla`` (the default, and the path generation always takes): the FP32 ``[B, H, T, S]`` score
  matrix is formed and masked with a dense boolean mask, through the model's matrix-product
  primitive (so ``compute_dtype`` means the same thing as in the projections);
- ``pallas``: the backend's fused kernel (``execution.fused_kernel``, :func:`fused_mix`).
  With ``runtime.backend: tpu``, splash attention (:mod:`.tpu_attention`). Elsewhere the
  flash-attention kernel ``jax.experimental.pallas.ops.gpu.attention.mha`` with
  ``segment_ids`` and ``causal=True`` (:func:`pallas_mix`). It walks key blocks with an online
  softmax and never holds more than a block of scores; its backward pass is a kernel too.
  Matrix inputs are the compute dtype, accumulation and softmax are FP32. On a GPU it runs
  natively; on CPU it runs in Pallas's interpreter (slow, for tests). Key/value heads are
  repeated to the query heads before the call (the kernel wants equal head counts).

The fused kernels need whole blocks (``execution.pallas_seq_len_problem``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .. import execution
from .primitives import F32, einsum


def segment_mask(segments_BxT):
    """[B, 1, T, T] bool: query t may attend to key s iff s <= t and both share a segment.

    Padding slots (segment 0) attend to earlier padding only; their outputs carry no loss.
    Every query sees at least itself, so no softmax row is empty.
    """
    T = segments_BxT.shape[1]
    causal_TxT = jnp.tril(jnp.ones((T, T), dtype=bool))
    same_BxTxT = segments_BxT[:, :, None] == segments_BxT[:, None, :]
    return (same_BxTxT & causal_TxT)[:, None, :, :]


def xla_mix(cfg, q_BxTxHxK, k_BxSxGxK, v_BxSxGxK, mask_Bx1xTxS):
    """Attention of T queries over S keys/values under a dense mask: ``[B, T, H*K]``."""
    B, T, H, K = q_BxTxHxK.shape
    S, G = k_BxSxGxK.shape[1], k_BxSxGxK.shape[2]
    fill = jnp.finfo(F32).min
    if cfg.execution.scan_layers:
        # Under lax.scan, JAX hoists what depends on the loop's constants alone out of the
        # loop: the mask broadcast over heads and the fill of the masked scores would be
        # materialised once ([B, H, T, S] bool and FP32) and read back by every layer's
        # forward, where a layer loop fuses them into the select (docs/tpu.md, "Ours against
        # the minimal loop"). Tied to the queries they depend on the layer and stay inside.
        mask_Bx1xTxS, fill, q_BxTxHxK = jax.lax.optimization_barrier(
            (mask_Bx1xTxS, jnp.asarray(fill, F32), q_BxTxHxK)
        )
    if G != H:
        # Grouped-query attention: query head h reads key/value head h // (H / G) (repeat_kv).
        k_BxSxGxK = jnp.repeat(k_BxSxGxK, H // G, axis=2)
        v_BxSxGxK = jnp.repeat(v_BxSxGxK, H // G, axis=2)
    # Heads to a contiguous [B*H, T, K] layout (the reshape after the transpose makes XLA
    # materialise it): batched dots of this canonical 3-D form run on the fast BF16 path,
    # 4-D ones are upcast to FP32 by XLA:CPU.
    N = B * H
    q_NxTxK = q_BxTxHxK.transpose(0, 2, 1, 3).reshape(N, T, K)
    k_NxSxK, v_NxSxK = (t.transpose(0, 2, 1, 3).reshape(N, S, K) for t in (k_BxSxGxK, v_BxSxGxK))
    scores_NxTxS = einsum(cfg, "ntk,nsk->nts", q_NxTxK, k_NxSxK, out_dtype=F32)
    scores_BxHxTxS = scores_NxTxS.reshape(B, H, T, S) * score_scale(cfg, K)
    cap = getattr(cfg, "attn_softcap", None)
    if cap is not None:  # Gemma 2: cap * tanh(scores / cap), before the mask
        scores_BxHxTxS = cap * jnp.tanh(scores_BxHxTxS / cap)
    scores_BxHxTxS = jnp.where(mask_Bx1xTxS, scores_BxHxTxS, fill)
    probs_NxTxS = jax.nn.softmax(scores_BxHxTxS, axis=-1).astype(cfg.dtype).reshape(N, T, S)
    out_NxTxK = einsum(cfg, "nts,nsk->ntk", probs_NxTxS, v_NxSxK)
    return out_NxTxK.reshape(B, H, T, K).transpose(0, 2, 1, 3).reshape(B, T, H * K)


def score_scale(cfg, K: int) -> float:
    """1/sqrt(K), or a Llama-family config's own (Gemma 2's ``query_pre_attn_scalar``)."""
    return getattr(cfg, "score_scale", K**-0.5)


def _interpret() -> bool:
    """Native kernel on a GPU, Pallas's interpreter on CPU; other backends are refused."""
    backend = jax.default_backend()
    if backend == "gpu":
        return False
    if backend == "cpu":
        return True
    raise ValueError(
        f"model.attention pallas: the fused kernel is a GPU (Triton) kernel, but the JAX "
        f"backend is {backend!r}; use model.attention xla, or on a TPU runtime.backend tpu"
    )


def pallas_mix(cfg, q_BxTxHxK, k_BxTxGxK, v_BxTxGxK, segments_BxT, block_sizes=None):
    """Fused segment-restricted causal attention of a packed row: ``[B, T, H*K]``.

    ``block_sizes`` (a Pallas ``BlockSizes``) overrides the kernel's tiling (tests use small
    blocks so segment boundaries fall inside blocks at tiny row lengths)."""
    from jax.experimental.pallas.ops.gpu import attention as pallas_attention

    B, T, H, K = q_BxTxHxK.shape
    G = k_BxTxGxK.shape[2]
    if block_sizes is None:
        problem = execution.pallas_seq_len_problem(T)
        if problem:
            raise ValueError(problem)
        block_sizes = pallas_attention.BlockSizes(
            block_q=execution.PALLAS_FORWARD_BLOCK,
            block_k=execution.PALLAS_FORWARD_BLOCK,
            block_q_dkv=execution.PALLAS_BACKWARD_BLOCK,
            block_kv_dkv=execution.PALLAS_BACKWARD_BLOCK,
            block_q_dq=execution.PALLAS_BACKWARD_BLOCK,
            block_kv_dq=execution.PALLAS_BACKWARD_BLOCK,
        )
    if G != H:
        k_BxTxGxK = jnp.repeat(k_BxTxGxK, H // G, axis=2)
        v_BxTxGxK = jnp.repeat(v_BxTxGxK, H // G, axis=2)
    dtype = cfg.dtype
    out_BxTxHxK = pallas_attention.mha(
        q_BxTxHxK.astype(dtype),
        k_BxTxGxK.astype(dtype),
        v_BxTxGxK.astype(dtype),
        segments_BxT.astype(jnp.int32),
        sm_scale=score_scale(cfg, K),
        causal=True,
        block_sizes=block_sizes,
        interpret=_interpret(),
    )
    return out_BxTxHxK.astype(dtype).reshape(B, T, H * K)


def window_mask(mask, q_positions_BxT, k_positions_BxS, window: int | None):
    """``mask`` (a dense ``[B, 1, T, S]`` one) restricted to a sliding window: query at
    position p sees key position s only if ``s > p - window`` (transformers' sliding-window
    mask, the query itself included), positions within the segment. ``window`` None, or a
    fused kernel's segment ids (the kernel takes the window itself, :func:`mix`): unchanged."""
    if window is None or mask.ndim == 2:
        return mask
    near_BxTxS = k_positions_BxS[:, None, :] > q_positions_BxT[:, :, None] - window
    return mask & near_BxTxS[:, None]


def packed_mask(cfg, segments_BxT):
    """What a layer's attention needs besides q, k, v, built once per forward: the dense
    ``[B, 1, T, T]`` mask for the XLA path, the ``[B, T]`` segment ids for the fused one."""
    if cfg.execution.attention == "pallas":
        return segments_BxT
    return segment_mask(segments_BxT)


def fused_mix(cfg, q_BxTxHxK, k_BxTxGxK, v_BxTxGxK, segments_BxT, window=None):
    """Fused attention of a packed row by the recipe's backend (``execution.fused_kernel``):
    splash attention for a TPU recipe, the GPU kernel otherwise. ``window``: the layer's
    sliding window (None: the whole segment)."""
    if execution.fused_kernel(cfg.execution.backend) == "splash":
        from . import tpu_attention

        scale = score_scale(cfg, q_BxTxHxK.shape[3])
        return tpu_attention.splash_mix(
            cfg, q_BxTxHxK, k_BxTxGxK, v_BxTxGxK, segments_BxT, window, scale=scale
        )
    T = q_BxTxHxK.shape[1]
    if window is not None and window < T:  # the config refuses it (llama_config)
        raise ValueError(f"model.attention pallas: the GPU kernel has no sliding window ({window})")
    return pallas_mix(cfg, q_BxTxHxK, k_BxTxGxK, v_BxTxGxK, segments_BxT)


#: the ``jax.checkpoint`` names of the attention's inputs (the rotated q, k, v) and output,
#: which a remat policy may keep (``layer_stack.SAVED_NAMES``); a name is an identity
NAME_INPUTS, NAME_OUTPUT = "attention_inputs", "attention_output"


def mix(cfg, q_BxTxHxK, k_BxSxGxK, v_BxSxGxK, mask, window=None):
    """Attention by ``cfg.execution.attention``; ``mask`` is :func:`packed_mask`'s, or any
    dense ``[B, 1, T, S]`` mask (generation with a cache), which always takes the XLA path.
    ``window``: the layer's sliding window, for the fused path (a dense mask holds its own:
    :func:`window_mask`)."""
    from jax.ad_checkpoint import checkpoint_name

    q_BxTxHxK, k_BxSxGxK, v_BxSxGxK = (
        checkpoint_name(t, NAME_INPUTS) for t in (q_BxTxHxK, k_BxSxGxK, v_BxSxGxK)
    )
    if mask.ndim == 2:
        out = fused_mix(cfg, q_BxTxHxK, k_BxSxGxK, v_BxSxGxK, mask, window)
    else:
        out = xla_mix(cfg, q_BxTxHxK, k_BxSxGxK, v_BxSxGxK, mask)
    return checkpoint_name(out, NAME_OUTPUT)
