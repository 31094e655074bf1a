"""Llama-family decoder (Llama, Mistral, Qwen2 layouts) over packed rows.

The same contracts as :mod:`.model` (packed rows of ``tokens``/``segments``/``positions``,
segment-restricted causal attention, per-segment positions, FP32 master parameters, every
matrix product through :func:`.primitives.einsum` so ``compute_dtype`` means the same thing),
with the Llama block instead of the GPT one (:mod:`.gpt`):

- RMSNorm (FP32 statistics, ``norm_eps``), no biases in norms or the MLP;
- rotary positions with base ``rope_theta`` (rotate-half form, as HF Llama);
- grouped-query attention: ``n_kv_heads`` key/value heads, each shared by
  ``n_heads / n_kv_heads`` query heads (query head h reads key/value head h // group);
- optional q/k/v projection biases (Qwen2), never an output-projection bias;
- SwiGLU MLP: ``down(silu(gate(x)) * up(x))``;
- output head tied to the token embedding or separate.

Parameters (``[in, out]`` matrices, as in :mod:`.gpt`; :mod:`.hf_checkpoint` holds the one
table mapping them to HF names)::

    embed/tokens [V, D]
    blocks/NN/attn_norm/scale [D]
    blocks/NN/attn/{wq [D, H*K], wk [D, G*K], wv [D, G*K], wo [H*K, D]}  (+ bq, bk, bv)
    blocks/NN/mlp_norm/scale [D]
    blocks/NN/mlp/{w_gate [D, F], w_up [D, F], w_down [F, D]}
    final_norm/scale [D]
    head/w [D, V]  (untied only)
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp

from ... import schemas
from . import attention, layer_stack, rotary
from . import sampling as sampling_rules
from .execution import Execution
from .primitives import F32, ArchitectureConfig, einsum, rotate, scaled_normal

ARCHITECTURE = "llama"
#: what an absent ``rope_theta``, ``norm_eps``, ``qkv_bias`` mean: the recipe schema says
_ABSENT = schemas.absent(schemas.PACKED_SFT, "model")


@dataclass(frozen=True)
class LlamaConfig(ArchitectureConfig):
    """Architecture and precision of a Llama-family model (hashable: a static jit argument)."""

    architecture = ARCHITECTURE
    INTEGER_FIELDS = (
        "vocab_size",
        "d_model",
        "n_layers",
        "n_heads",
        "n_kv_heads",
        "d_ff",
        "max_len",
    )
    FLAG_FIELDS = ("qkv_bias", "tie_embeddings")

    vocab_size: int
    d_model: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    d_ff: int
    max_len: int
    rope_theta: float = _ABSENT["rope_theta"]
    norm_eps: float = _ABSENT["norm_eps"]
    qkv_bias: bool = _ABSENT["qkv_bias"]
    tie_embeddings: bool = False
    compute_dtype: str = "bfloat16"
    #: ``rope_scaling`` as sorted (key, value) pairs, empty for the plain rotary (:mod:`.rotary`)
    rope_scaling: tuple = ()
    #: how it computes, not architecture: ``to_dict`` leaves it out (see :mod:`.execution`)
    execution: Execution = Execution()

    def __post_init__(self):
        if isinstance(self.rope_scaling, dict):  # to_dict's form (model.json)
            object.__setattr__(self, "rope_scaling", tuple(sorted(self.rope_scaling.items())))
        super().__post_init__()

    def architecture_errors(self, sizes_valid: bool) -> list[str]:
        errors = []
        if sizes_valid:
            if self.d_model % self.n_heads:
                errors.append(
                    f"model.d_model: {self.d_model} is not divisible by model.n_heads={self.n_heads}"
                )
            elif self.head_dim % 2:
                errors.append(f"model.n_heads: rotary needs an even head size, got {self.head_dim}")
            if self.n_heads % self.n_kv_heads:
                errors.append(
                    f"model.n_kv_heads: {self.n_kv_heads} does not divide "
                    f"model.n_heads={self.n_heads}"
                )
        for name in ("rope_theta", "norm_eps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, float) or not value > 0:
                errors.append(f"model.{name}: expected a positive float, got {value!r}")
        return errors

    def to_dict(self) -> dict:
        out = {"architecture": ARCHITECTURE, **super().to_dict()}
        out["rope_scaling"] = dict(self.rope_scaling)
        if not self.rope_scaling:  # configs without it keep their recorded form
            del out["rope_scaling"]
        return out


# ----------------------------------------------------------------------------- parameters


def init_params(cfg: LlamaConfig, key) -> dict:
    """FP32 parameters: embeddings N(0, 0.02), matrices N(0, 1/fan_in) with the two residual
    writers (``wo``, ``w_down``) scaled by 1/sqrt(2 n_layers); biases 0, norm scales 1."""
    D, F, V, L = cfg.d_model, cfg.d_ff, cfg.vocab_size, cfg.n_layers
    HK, GK = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    keys = iter(jax.random.split(key, 2 + 7 * L))
    residual_scale = 1.0 / math.sqrt(2 * L)

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
        params["blocks"][f"{i:02d}"] = {
            "attn_norm": {"scale": jnp.ones((D,), F32)},
            "attn": attn,
            "mlp_norm": {"scale": jnp.ones((D,), F32)},
            "mlp": {
                "w_gate": normal((D, F), D**-0.5),
                "w_up": normal((D, F), D**-0.5),
                "w_down": normal((F, D), F**-0.5 * residual_scale),
            },
        }
    if not cfg.tie_embeddings:
        params["head"] = {"w": normal((D, V), D**-0.5)}
    return params


# ----------------------------------------------------------------------------- layers


@jax.tree_util.register_pytree_node_class
class LoraWeight:
    """A frozen ``[in, out]`` matrix with a low-rank adapter (see :mod:`.lora`): it multiplies
    as ``x @ base + scale * (x @ a) @ b``. Built inside the traced step only."""

    def __init__(self, base, a, b, scale: float):
        self.base, self.a, self.b, self.scale = base, a, b, scale

    def tree_flatten(self):
        return (self.base, self.a, self.b), self.scale

    @classmethod
    def tree_unflatten(cls, scale, children):
        return cls(*children, scale)


def _linear(cfg: LlamaConfig, x_BxTxK, w):
    """x @ w as an FP32 accumulator, for a plain matrix or a :class:`LoraWeight` (whose
    adapter's inner product is rounded to the compute dtype, like any activation)."""
    if isinstance(w, LoraWeight):
        y_BxTxN = einsum(cfg, "btk,kn->btn", x_BxTxK, w.base, out_dtype=F32)
        down_BxTxR = einsum(cfg, "btk,kr->btr", x_BxTxK, w.a)
        return y_BxTxN + w.scale * einsum(cfg, "btr,rn->btn", down_BxTxR, w.b, out_dtype=F32)
    return einsum(cfg, "btk,kn->btn", x_BxTxK, w, out_dtype=F32)


def _rms_norm(cfg: LlamaConfig, x_BxTxD, norm):
    """x / sqrt(mean(x^2) + eps) * scale, statistics in FP32."""
    x = x_BxTxD.astype(F32)
    mean_sq_BxTx1 = jnp.mean(jax.lax.square(x), axis=-1, keepdims=True)
    return (x * jax.lax.rsqrt(mean_sq_BxTx1 + cfg.norm_eps) * norm["scale"]).astype(cfg.dtype)


def _project(cfg: LlamaConfig, x_BxTxK, w_KxN, b_N=None):
    """x @ w (+ b added to the FP32 accumulator), rounded to the compute dtype."""
    y_BxTxN = _linear(cfg, x_BxTxK, w_KxN)
    if b_N is not None:
        y_BxTxN = y_BxTxN + b_N
    return y_BxTxN.astype(cfg.dtype)


def _qkv(cfg: LlamaConfig, x_BxTxD, p, positions_BxT):
    """Rotated queries ``[B, T, H, K]`` and keys, values ``[B, T, G, K]`` (compute dtype)."""
    B, T, _ = x_BxTxD.shape
    H, G, K = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    q_BxTxHxK = _project(cfg, x_BxTxD, p["wq"], p.get("bq")).reshape(B, T, H, K)
    k_BxTxGxK = _project(cfg, x_BxTxD, p["wk"], p.get("bk")).reshape(B, T, G, K)
    v_BxTxGxK = _project(cfg, x_BxTxD, p["wv"], p.get("bv")).reshape(B, T, G, K)
    inv_freq_K2 = rotary.inv_freq(cfg.rope_theta, K // 2, cfg.rope_scaling)
    q_BxTxHxK = rotate(q_BxTxHxK, positions_BxT, inv_freq_K2=inv_freq_K2)
    k_BxTxGxK = rotate(k_BxTxGxK, positions_BxT, inv_freq_K2=inv_freq_K2)
    return q_BxTxHxK, k_BxTxGxK, v_BxTxGxK


def _mix(cfg: LlamaConfig, q_BxTxHxK, k_BxSxGxK, v_BxSxGxK, mask, p):
    """Attention of T queries over S keys/values (S = T in training, the cache length when
    generating), then the output projection. ``mask``: :func:`.attention.packed_mask`'s, or a
    dense ``[B, 1, T, S]`` one; grouped-query heads as in :func:`.attention.xla_mix`."""
    out_BxTxHK = attention.mix(cfg, q_BxTxHxK, k_BxSxGxK, v_BxSxGxK, mask)
    return _project(cfg, out_BxTxHK, p["wo"])


def _attention(cfg: LlamaConfig, x_BxTxD, p, mask_Bx1xTxT, positions_BxT):
    q_BxTxHxK, k_BxTxGxK, v_BxTxGxK = _qkv(cfg, x_BxTxD, p, positions_BxT)
    return _mix(cfg, q_BxTxHxK, k_BxTxGxK, v_BxTxGxK, mask_Bx1xTxT, p)


def _swiglu(cfg: LlamaConfig, x_BxTxD, p):
    gate_BxTxF = _linear(cfg, x_BxTxD, p["w_gate"])
    up_BxTxF = _linear(cfg, x_BxTxD, p["w_up"])
    act_BxTxF = (jax.nn.silu(gate_BxTxF) * up_BxTxF).astype(cfg.dtype)
    return _project(cfg, act_BxTxF, p["w_down"])


def head(params, cfg: LlamaConfig, h_BxTxD):
    """FP32 logits from the last hidden states (final norm, then the tied or separate head)."""
    h_BxTxD = _rms_norm(cfg, h_BxTxD, params["final_norm"])
    if cfg.tie_embeddings:
        return einsum(cfg, "btd,vd->btv", h_BxTxD, params["embed"]["tokens"], out_dtype=F32)
    return einsum(cfg, "btd,dv->btv", h_BxTxD, params["head"]["w"], out_dtype=F32)


def forward(params, cfg: LlamaConfig, tokens_BxT, segments_BxT, positions_BxT):
    """Logits ``[B, T, V]`` (FP32) for every slot of a packed batch (see :func:`.model.forward`)."""
    return head(params, cfg, hidden(params, cfg, tokens_BxT, segments_BxT, positions_BxT))


def hidden(params, cfg: LlamaConfig, tokens_BxT, segments_BxT, positions_BxT):
    """The residual stream after the last block (before the final norm, see
    :func:`.model.hidden`); the blocks run as :mod:`.layer_stack` says."""
    h_BxTxD = params["embed"]["tokens"][tokens_BxT].astype(cfg.dtype)
    mask = attention.packed_mask(cfg, segments_BxT)

    def block_fn(block, h_BxTxD):
        a_BxTxD = _rms_norm(cfg, h_BxTxD, block["attn_norm"])
        h_BxTxD = h_BxTxD + _attention(cfg, a_BxTxD, block["attn"], mask, positions_BxT)
        a_BxTxD = _rms_norm(cfg, h_BxTxD, block["mlp_norm"])
        return h_BxTxD + _swiglu(cfg, a_BxTxD, block["mlp"])

    names = layer_stack.layer_names(params["blocks"])
    return layer_stack.run_blocks(cfg.execution, params["blocks"], names, block_fn, h_BxTxD)


def flops_per_token(cfg: LlamaConfig, seq_len: int) -> float:
    """6 x (matrix weights: q, o of D x H*K; k, v of D x G*K; 3 D x F; the D x V head)
    + 12 x layers x seq_len x H*K for attention scores and mixing."""
    D, F, L, V = cfg.d_model, cfg.d_ff, cfg.n_layers, cfg.vocab_size
    HK, GK = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    matmul_params = L * (2 * D * HK + 2 * D * GK + 3 * D * F) + D * V
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
    rows_BxT = jnp.broadcast_to(jnp.arange(B)[:, None], (B, T))
    # query at position t sees cache slot s iff s <= t (one causal segment per row)
    mask_Bx1xTxS = (jnp.arange(S)[None, None, :] <= positions_BxT[:, :, None])[:, None]
    h_BxTxD = params["embed"]["tokens"][tokens_BxT].astype(cfg.dtype)
    new_cache = {}
    for name in sorted(params["blocks"], key=int):
        block = params["blocks"][name]
        a_BxTxD = _rms_norm(cfg, h_BxTxD, block["attn_norm"])
        q_BxTxHxK, k_BxTxGxK, v_BxTxGxK = _qkv(cfg, a_BxTxD, block["attn"], positions_BxT)
        k_BxSxGxK = cache[name]["k"].at[rows_BxT, positions_BxT].set(k_BxTxGxK)
        v_BxSxGxK = cache[name]["v"].at[rows_BxT, positions_BxT].set(v_BxTxGxK)
        new_cache[name] = {"k": k_BxSxGxK, "v": v_BxSxGxK}
        h_BxTxD = h_BxTxD + _mix(cfg, q_BxTxHxK, k_BxSxGxK, v_BxSxGxK, mask_Bx1xTxS, block["attn"])
        a_BxTxD = _rms_norm(cfg, h_BxTxD, block["mlp_norm"])
        h_BxTxD = h_BxTxD + _swiglu(cfg, a_BxTxD, block["mlp"])
    last_Bx1xD = h_BxTxD[jnp.arange(B), last_B][:, None, :]
    return head(params, cfg, last_Bx1xD)[:, 0], new_cache


@functools.partial(jax.jit, static_argnums=(1,))
def generate_rows_cached(
    params, cfg: LlamaConfig, buffer_BxL, max_new, lengths_B, stops_S, sampling, seed
):
    """:func:`.model._generate_rows` with a key/value cache: the prompt buffer runs through
    the model once, then each new token costs one single-position step instead of a full
    forward over the buffer. The same loop, stopping rules and outputs."""
    B, L = buffer_BxL.shape
    rows_B = jnp.arange(B)
    positions_BxL = jnp.broadcast_to(jnp.arange(L, dtype=jnp.int32), (B, L))
    logits_BxV, cache = forward_cached(
        params,
        cfg,
        buffer_BxL,
        positions_BxL,
        empty_cache(cfg, B, L),
        jnp.maximum(lengths_B - 1, 0),
    )

    def cond(carry):
        i, _, _, done_B, _, _ = carry
        return (i < max_new) & ~jnp.all(done_B)

    def body(carry):
        i, buf_BxL, len_B, done_B, logits_BxV, cache = carry
        next_B = sampling_rules.choose(logits_BxV, sampling, seed, i)
        write_B = ~done_B
        slot_B = jnp.minimum(len_B, L - 1)
        buf_BxL = buf_BxL.at[rows_B, slot_B].set(
            jnp.where(write_B, next_B, buf_BxL[rows_B, slot_B])
        )
        len_B = len_B + write_B.astype(jnp.int32)
        done_B = done_B | (write_B & sampling_rules.is_stop(next_B, stops_S)) | (len_B >= L)
        # The token just written (a finished row rewrites its last slot with the same values).
        last_B = jnp.minimum(len_B - 1, L - 1)
        token_Bx1 = buf_BxL[rows_B, last_B][:, None]
        logits_BxV, cache = forward_cached(
            params, cfg, token_Bx1, last_B[:, None], cache, jnp.zeros((B,), jnp.int32)
        )
        return i + 1, buf_BxL, len_B, done_B, logits_BxV, cache

    done0_B = lengths_B >= L
    carry = (jnp.int32(0), buffer_BxL, lengths_B, done0_B, logits_BxV, cache)
    _, buf_BxL, len_B, _, _, _ = jax.lax.while_loop(cond, body, carry)
    return buf_BxL, len_B
