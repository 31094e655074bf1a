"""Llama-family decoder (Llama, Mistral, Qwen2 layouts) over packed rows.

The same contracts as :mod:`.model` (packed rows of ``tokens``/``segments``/``positions``,
segment-restricted causal attention, per-segment positions, FP32 master parameters, every
matrix product through :func:`minifield.models.layers.primitives.einsum` so ``compute_dtype`` means the same thing),
with the Llama block instead of the GPT one (:mod:`.gpt`):

- RMSNorm (FP32 statistics, ``norm_eps``), no biases in norms or the MLP;
- rotary positions with base ``rope_theta`` (rotate-half form, as HF Llama);
- grouped-query attention: ``n_kv_heads`` key/value heads, each shared by
  ``n_heads / n_kv_heads`` query heads (query head h reads key/value head h // group);
- optional q/k/v projection biases (Qwen2), never an output-projection bias;
- optional per-head RMSNorm of queries and keys before rotary (Qwen3), and a head width
  ``head_dim`` that need not be ``d_model / n_heads``;
- optional sliding-window attention (Mistral, Qwen): on every layer or those
  ``layer_types`` names (:func:`minifield.models.layers.attention.window_mask`);
- gated MLP: ``down(act(gate(x)) * up(x))``, ``act`` SiLU (SwiGLU) or GELU (Gemma's GeGLU);
  or, with ``n_experts``, a mixture of such MLPs with a top-k router (Mixtral, :mod:`.moe`);
- Gemma: RMSNorm scaled by ``1 + w``, embeddings multiplied by ``sqrt(d_model)``;
- output head tied to the token embedding or separate.

Parameters (``[in, out]`` matrices, as in :mod:`.gpt`; :mod:`.families` holds the one
table mapping them to HF names)::

    embed/tokens [V, D]
    blocks/NN/attn_norm/scale [D]
    blocks/NN/attn/{wq [D, H*K], wk [D, G*K], wv [D, G*K], wo [H*K, D]}
                  (+ bq, bk, bv with qkv_bias; q_norm [K], k_norm [K] with qk_norm)
    blocks/NN/mlp_norm/scale [D]
    blocks/NN/mlp/{w_gate [D, F], w_up [D, F], w_down [F, D]}
                  (n_experts: blocks/NN/moe/{router [D, E], experts/{w_gate [E, D, F],
                  w_up [E, D, F], w_down [E, F, D]}}: the experts stacked)
    final_norm/scale [D]
    head/w [D, V]  (untied only)
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp

from . import moe, quantize, rope_scaling
from .layers import attention, layer_stack
from .layers.primitives import F32, einsum, linear, rotate, scaled_normal

# the config's home is :mod:`.llama_config`; its names are this module's too
from .llama_config import ARCHITECTURE as ARCHITECTURE
from .llama_config import LlamaConfig

# ----------------------------------------------------------------------------- parameters


def init_params(cfg: LlamaConfig, key) -> dict:
    """FP32 parameters: embeddings N(0, 0.02), matrices N(0, 1/fan_in) with the two residual
    writers (``wo``, ``w_down``) scaled by 1/sqrt(2 n_layers); biases 0, norm scales 1."""
    D, F, V, L = cfg.d_model, cfg.d_ff, cfg.vocab_size, cfg.n_layers
    HK, GK = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    # per layer 4 attention keys and the MLP's 3 (experts: the router's 1 and 3 per expert,
    # a shared expert's 3 and its gate's 1)
    per_layer = 5 + 3 * cfg.n_experts + 4 * bool(cfg.shared_expert_d_ff) if cfg.n_experts else 7
    keys = iter(jax.random.split(key, 2 + per_layer * L))
    residual_scale = 1.0 / math.sqrt(2 * L)
    norm_width = (HK, GK) if cfg.qk_norm_whole else (cfg.head_dim, cfg.head_dim)

    def normal(shape, std):
        return scaled_normal(next(keys), shape, std)

    params: dict[str, Any] = {
        "embed": {"tokens": normal((V, D), 0.02)},
        "blocks": {},
        "final_norm": {"scale": jnp.ones((D,), F32)},
    }
    for i in range(L):
        attn = {
            "wq": normal((D, HK), D**-0.5),
            "wk": normal((D, GK), D**-0.5),
            "wv": normal((D, GK), D**-0.5),
            "wo": normal((HK, D), HK**-0.5 * residual_scale),
        }
        if cfg.qkv_bias:
            attn.update(
                bq=jnp.zeros((HK,), F32), bk=jnp.zeros((GK,), F32), bv=jnp.zeros((GK,), F32)
            )
        if cfg.qk_norm:
            attn.update(
                q_norm=jnp.ones((norm_width[0],), F32), k_norm=jnp.ones((norm_width[1],), F32)
            )
        params["blocks"][f"{i:02d}"] = {
            "attn_norm": {"scale": jnp.ones((D,), F32)},
            "attn": attn,
            "mlp_norm": {"scale": jnp.ones((D,), F32)},
        }

        def mlp(F):
            return {
                "w_gate": normal((D, F), D**-0.5),
                "w_up": normal((D, F), D**-0.5),
                "w_down": normal((F, D), F**-0.5 * residual_scale),
            }

        if cfg.is_moe_layer(i):
            router = normal((D, cfg.n_experts), D**-0.5)
            experts = [mlp(cfg.expert_d_ff) for _ in range(cfg.n_experts)]  # keys in order
            layer_moe = {
                "router": router,
                "experts": {k: jnp.stack([e[k] for e in experts]) for k in experts[0]},
            }
            if cfg.shared_expert_d_ff:
                layer_moe["shared"] = mlp(cfg.shared_expert_d_ff)
                layer_moe["shared_gate"] = normal((D, 1), D**-0.5)
            params["blocks"][f"{i:02d}"]["moe"] = layer_moe
        else:
            params["blocks"][f"{i:02d}"]["mlp"] = mlp(F)
    if not cfg.tie_embeddings:
        params["head"] = {"w": normal((D, V), D**-0.5)}
    return params


# ----------------------------------------------------------------------------- layers


def _rms_norm(cfg: LlamaConfig, x_BxTxD, norm):
    """x / sqrt(mean(x^2) + eps) * scale (Gemma: * (1 + scale)), statistics in FP32."""
    x = x_BxTxD.astype(F32)
    mean_sq_BxTx1 = jnp.mean(jax.lax.square(x), axis=-1, keepdims=True)
    scale = 1.0 + norm["scale"] if cfg.norm_plus_one else norm["scale"]
    return (x * jax.lax.rsqrt(mean_sq_BxTx1 + cfg.norm_eps) * scale).astype(cfg.dtype)


#: ``activation`` -> the MLP's gate function (gelu_tanh: GELU's tanh approximation, as
#: PyTorch's ``gelu(approximate="tanh")``)
_ACTIVATIONS = {
    "silu": jax.nn.silu,
    "gelu_tanh": lambda x: jax.nn.gelu(x, approximate=True),
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),
}


def _embed(params, cfg: LlamaConfig, tokens_BxT):
    """Token embeddings in the compute dtype (Gemma: times sqrt(d_model), itself rounded to
    the compute dtype first, as transformers' ``normalizer``)."""
    # an array, or a frozen table in the host's memory (``HostTable``: its rows gathered there)
    h_BxTxD = params["embed"]["tokens"][tokens_BxT].astype(cfg.dtype)
    if cfg.scale_embeddings:
        h_BxTxD = h_BxTxD * jnp.asarray(cfg.d_model**0.5, cfg.dtype)
    return h_BxTxD


def _project(cfg: LlamaConfig, x_BxTxK, w_KxN, b_N=None):
    """x @ w (+ b added to the FP32 accumulator), rounded to the compute dtype."""
    y_BxTxN = linear(cfg, x_BxTxK, w_KxN)
    if b_N is not None:
        y_BxTxN = y_BxTxN + b_N
    return y_BxTxN.astype(cfg.dtype)


def _qkv(cfg: LlamaConfig, x_BxTxD, p, positions_BxT, window=None):
    """Rotated queries ``[B, T, H, K]`` and keys, values ``[B, T, G, K]`` (compute dtype);
    ``window``: the layer's sliding window (Gemma 3 rotates those layers by another base)."""
    B, T, _ = x_BxTxD.shape
    H, G, K = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    q_BxTxHK = _project(cfg, x_BxTxD, p["wq"], p.get("bq"))
    k_BxTxGK = _project(cfg, x_BxTxD, p["wk"], p.get("bk"))
    if cfg.qk_norm_whole:  # over the whole projection, before rotary (OLMoE)
        q_BxTxHK = _rms_norm(cfg, q_BxTxHK, {"scale": p["q_norm"]})
        k_BxTxGK = _rms_norm(cfg, k_BxTxGK, {"scale": p["k_norm"]})
    q_BxTxHxK = q_BxTxHK.reshape(B, T, H, K)
    k_BxTxGxK = k_BxTxGK.reshape(B, T, G, K)
    v_BxTxGxK = _project(cfg, x_BxTxD, p["wv"], p.get("bv")).reshape(B, T, G, K)
    if cfg.qk_norm and not cfg.qk_norm_whole:  # per head, before rotary (Qwen3)
        q_BxTxHxK = _rms_norm(cfg, q_BxTxHxK, {"scale": p["q_norm"]})
        k_BxTxGxK = _rms_norm(cfg, k_BxTxGxK, {"scale": p["k_norm"]})
    theta, scaling = cfg.rope_theta, cfg.rope_scaling
    if window is not None and cfg.rope_local_theta is not None:
        theta, scaling = cfg.rope_local_theta, ()
    inv_freq_K2 = rope_scaling.inv_freq(theta, K // 2, scaling)
    scale = rope_scaling.amplitude(scaling)
    q_BxTxHxK = rotate(q_BxTxHxK, positions_BxT, inv_freq_K2=inv_freq_K2, scale=scale)
    k_BxTxGxK = rotate(k_BxTxGxK, positions_BxT, inv_freq_K2=inv_freq_K2, scale=scale)
    return q_BxTxHxK, k_BxTxGxK, v_BxTxGxK


def _mix(cfg: LlamaConfig, q_BxTxHxK, k_BxSxGxK, v_BxSxGxK, mask, p, window=None):
    """Attention of T queries over S keys/values (S = T in training, the cache length when
    generating), then the output projection. ``mask``: :func:`minifield.models.layers.attention.packed_mask`'s, or a
    dense ``[B, 1, T, S]`` one; grouped-query heads as in :func:`minifield.models.layers.attention.xla_mix`;
    ``window``: the layer's, for a fused kernel (:func:`minifield.models.layers.attention.mix`)."""
    out_BxTxHK = attention.mix(cfg, q_BxTxHxK, k_BxSxGxK, v_BxSxGxK, mask, window)
    return _project(cfg, out_BxTxHK, p["wo"])


def _attention(cfg: LlamaConfig, x_BxTxD, p, mask_Bx1xTxT, positions_BxT, window):
    q_BxTxHxK, k_BxTxGxK, v_BxTxGxK = _qkv(cfg, x_BxTxD, p, positions_BxT, window)
    return _mix(cfg, q_BxTxHxK, k_BxTxGxK, v_BxTxGxK, mask_Bx1xTxT, p, window)


def _swiglu(cfg: LlamaConfig, x_BxTxD, p):
    gate_BxTxF = linear(cfg, x_BxTxD, p["w_gate"])
    up_BxTxF = linear(cfg, x_BxTxD, p["w_up"])
    act_BxTxF = (_ACTIVATIONS[cfg.activation](gate_BxTxF) * up_BxTxF).astype(cfg.dtype)
    return _project(cfg, act_BxTxF, p["w_down"])


def _mlp(cfg: LlamaConfig, x_BxTxD, block):
    """The block's MLP (dense, or the experts: :mod:`.moe`) and its router logits or None."""
    if "moe" in block:
        return moe.moe_mlp(cfg, x_BxTxD, block["moe"], with_logits=True)
    return _swiglu(cfg, x_BxTxD, block["mlp"]), None


def head(params, cfg: LlamaConfig, h_BxTxD):
    """FP32 logits from the last hidden states (final norm, then the tied or separate head;
    Gemma 2: soft-capped)."""
    h_BxTxD = _rms_norm(cfg, h_BxTxD, params["final_norm"])
    if cfg.tie_embeddings:
        logits = einsum(cfg, "btd,vd->btv", h_BxTxD, params["embed"]["tokens"], out_dtype=F32)
    else:
        logits = einsum(cfg, "btd,dv->btv", h_BxTxD, params["head"]["w"], out_dtype=F32)
    if cfg.final_softcap is not None:
        logits = cfg.final_softcap * jnp.tanh(logits / cfg.final_softcap)
    return logits


def _add(cfg: LlamaConfig, h_BxTxD, out_BxTxD, block, post_norm: str):
    """The residual stream plus a sublayer's output (Gemma 2: normalised first)."""
    if cfg.sandwich_norms:
        out_BxTxD = _rms_norm(cfg, out_BxTxD, block[post_norm])
    return h_BxTxD + out_BxTxD


def forward(params, cfg: LlamaConfig, tokens_BxT, segments_BxT, positions_BxT):
    """Logits ``[B, T, V]`` (FP32) for every slot of a packed batch (see :func:`.model.forward`)."""
    return head(params, cfg, hidden(params, cfg, tokens_BxT, segments_BxT, positions_BxT))


def hidden(params, cfg: LlamaConfig, tokens_BxT, segments_BxT, positions_BxT, router=False):
    """The residual stream after the last block, before the final norm (:func:`.model.hidden`;
    ``router``: and the sparse layers' FP32 router logits ``[L, B*T, E]``, :mod:`.router_loss`)."""
    h_BxTxD, mask = _embed(params, cfg, tokens_BxT), attention.packed_mask(cfg, segments_BxT)

    def block_fn(mask, window):
        def fn(block, h_BxTxD):
            h_BxTxD, logits_NxE = _block(cfg, block, h_BxTxD, mask, positions_BxT, window)
            return h_BxTxD, logits_NxE if router else None  # (run_blocks collects them)

        return fn

    names = layer_stack.layer_names(params["blocks"])
    windows = [cfg.layer_window(i) for i in range(cfg.n_layers)]
    masks = {w: attention.window_mask(mask, positions_BxT, positions_BxT, w) for w in set(windows)}
    groups = [(names, windows[0])]  # one body for every layer (a scan needs it), else
    if len(masks) > 1:  # layer by layer, each its own mask (scan_layers is refused for these)
        groups = list(zip([[n] for n in names], windows, strict=True))
    logits = []
    for group, window in groups:
        fn = block_fn(masks[window], window)
        h_BxTxD, more = layer_stack.run_blocks(
            cfg.execution, params["blocks"], group, fn, h_BxTxD, collect=True
        )
        logits += more
    return (h_BxTxD, jnp.concatenate(logits)) if router else h_BxTxD


def _block(cfg: LlamaConfig, block, h_BxTxD, mask, positions_BxT, window):
    """One decoder layer: the residual stream after it and its router logits (or None)."""
    a_BxTxD = _rms_norm(cfg, h_BxTxD, block["attn_norm"])
    out_BxTxD = _attention(cfg, a_BxTxD, block["attn"], mask, positions_BxT, window)
    h_BxTxD = _add(cfg, h_BxTxD, out_BxTxD, block, "attn_post_norm")
    a_BxTxD = _rms_norm(cfg, h_BxTxD, block["mlp_norm"])
    out_BxTxD, logits_NxE = _mlp(cfg, a_BxTxD, block)
    return _add(cfg, h_BxTxD, out_BxTxD, block, "mlp_post_norm"), logits_NxE


def embed(params, cfg: LlamaConfig, tokens_BxT, positions_BxT):
    """The residual stream before the first layer (:func:`.model.embed`)."""
    del positions_BxT  # rotary: the layers take the positions
    return _embed(params, cfg, tokens_BxT)


def layer(block, cfg: LlamaConfig, window, h_BxTxD, segments_BxT, positions_BxT):
    """One layer alone, its sliding ``window`` (``cfg.layer_window``; :func:`.model.layer`):
    the same arithmetic as :func:`hidden`'s layer, its mask built as :func:`hidden` builds it."""
    mask = attention.packed_mask(cfg, segments_BxT)
    mask = attention.window_mask(mask, positions_BxT, positions_BxT, window)
    return _block(cfg, block, h_BxTxD, mask, positions_BxT, window)[0]


def flops_per_token(cfg: LlamaConfig, seq_len: int) -> float:
    """6 x (matrix weights: q, o of D x H*K; k, v of D x G*K; 3 D x F; the D x V head)
    + 12 x layers x seq_len x H*K for attention scores and mixing. With experts: the
    3 D x F of the k experts a token goes through, the D x E router, a shared expert and its
    gate; the dense layers' 3 D x F."""
    D, F, L, V = cfg.d_model, cfg.d_ff, cfg.n_layers, cfg.vocab_size
    HK, GK = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    sparse = 3 * D * cfg.expert_d_ff * cfg.experts_per_token + D * cfg.n_experts
    if cfg.shared_expert_d_ff:
        sparse += 3 * D * cfg.shared_expert_d_ff + D
    mlp = sum(sparse if cfg.is_moe_layer(i) else 3 * D * F for i in range(L))
    matmul_params = L * (2 * D * HK + 2 * D * GK) + mlp + D * V
    return float(6 * matmul_params + 12 * L * seq_len * HK)


# ----------------------------------------------------------------------------- generation


def empty_cache(cfg: LlamaConfig, batch: int, length: int) -> dict:
    """Key/value cache: per layer ``[B, L, G, K]`` keys and values in the compute dtype."""
    shape = (batch, length, cfg.n_kv_heads, cfg.head_dim)
    return {
        f"{i:02d}": {"k": jnp.zeros(shape, cfg.dtype), "v": jnp.zeros(shape, cfg.dtype)}
        for i in range(cfg.n_layers)
    }


def forward_cached(params, cfg: LlamaConfig, tokens_BxT, positions_BxT, cache, last_B):
    """One generation step over a single unpacked row per batch entry.

    The keys and values of ``tokens`` are written into ``cache`` at their ``positions``;
    each query attends to every cache slot at or before its own position (slots after it
    may hold stale values and are masked, exactly as the full forward masks the slots after
    the prompt). Returns the FP32 logits at slot ``last_B[b]`` of each row ``[B, V]`` and the
    updated cache. ``T`` is the whole buffer for the prompt (prefill) and 1 per new token.
    """
    B, T = tokens_BxT.shape
    S = next(iter(cache.values()))["k"].shape[1]
    # a scanned run's evaluation may hold its blocks stacked (a LoRA base placed stacked,
    # hf.stored_base.stacked): each layer is its slice here, the cache is per layer
    params = layer_stack.per_layer(params)
    rows_BxT = jnp.broadcast_to(jnp.arange(B)[:, None], (B, T))
    # query at position t sees cache slot s iff s <= t (one causal segment per row)
    mask_Bx1xTxS = (jnp.arange(S)[None, None, :] <= positions_BxT[:, :, None])[:, None]
    h_BxTxD = _embed(params, cfg, tokens_BxT)
    new_cache = {}
    for name in sorted(params["blocks"], key=int):
        block = quantize.made_back_after(params["blocks"][name], h_BxTxD)
        window = cfg.layer_window(int(name))
        slots_BxS = jnp.broadcast_to(jnp.arange(S), (B, S))  # a slot holds its own position
        layer_mask = attention.window_mask(mask_Bx1xTxS, positions_BxT, slots_BxS, window)
        a_BxTxD = _rms_norm(cfg, h_BxTxD, block["attn_norm"])
        q_BxTxHxK, k_BxTxGxK, v_BxTxGxK = _qkv(cfg, a_BxTxD, block["attn"], positions_BxT, window)
        k_BxSxGxK = cache[name]["k"].at[rows_BxT, positions_BxT].set(k_BxTxGxK)
        v_BxSxGxK = cache[name]["v"].at[rows_BxT, positions_BxT].set(v_BxTxGxK)
        new_cache[name] = {"k": k_BxSxGxK, "v": v_BxSxGxK}
        out_BxTxD = _mix(cfg, q_BxTxHxK, k_BxSxGxK, v_BxSxGxK, layer_mask, block["attn"])
        h_BxTxD = _add(cfg, h_BxTxD, out_BxTxD, block, "attn_post_norm")
        a_BxTxD = _rms_norm(cfg, h_BxTxD, block["mlp_norm"])
        h_BxTxD = _add(cfg, h_BxTxD, _mlp(cfg, a_BxTxD, block)[0], block, "mlp_post_norm")
    last_Bx1xD = h_BxTxD[jnp.arange(B), last_B][:, None, :]
    return head(params, cfg, last_Bx1xD)[:, 0], new_cache
