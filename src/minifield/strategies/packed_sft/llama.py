"""Llama-family decoder (Llama, Mistral, Qwen2 layouts) over packed rows.

The same contracts as :mod:`.model` (packed rows of ``tokens``/``segments``/``positions``,
segment-restricted causal attention, per-segment positions, FP32 master parameters, every
matrix product through :func:`.model._einsum` so ``compute_dtype`` means the same thing), with
the Llama block instead of the GPT one:

- RMSNorm (FP32 statistics, ``norm_eps``), no biases in norms or the MLP;
- rotary positions with base ``rope_theta`` (rotate-half form, as HF Llama);
- grouped-query attention: ``n_kv_heads`` key/value heads, each shared by
  ``n_heads / n_kv_heads`` query heads (query head h reads key/value head h // group);
- optional q/k/v projection biases (Qwen2), never an output-projection bias;
- SwiGLU MLP: ``down(silu(gate(x)) * up(x))``;
- output head tied to the token embedding or separate.

Parameters (``[in, out]`` matrices, as in :mod:`.model`; :mod:`.hf_checkpoint` holds the one
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

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, ClassVar

import jax
import jax.numpy as jnp

from .model import BF16, COMPUTE_DTYPES, F32, _einsum, _rotate, segment_mask

ARCHITECTURE = "llama"
DEFAULTS = {"rope_theta": 10000.0, "norm_eps": 1e-6, "qkv_bias": False}


@dataclass(frozen=True)
class LlamaConfig:
    """Architecture and precision of a Llama-family model (hashable: a static jit argument)."""

    architecture: ClassVar[str] = ARCHITECTURE

    vocab_size: int
    d_model: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    d_ff: int
    max_len: int
    rope_theta: float = DEFAULTS["rope_theta"]
    norm_eps: float = DEFAULTS["norm_eps"]
    qkv_bias: bool = DEFAULTS["qkv_bias"]
    tie_embeddings: bool = False
    compute_dtype: str = "bfloat16"

    def __post_init__(self):
        errors = []
        for name in (
            "vocab_size",
            "d_model",
            "n_layers",
            "n_heads",
            "n_kv_heads",
            "d_ff",
            "max_len",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                errors.append(f"model.{name}: expected a positive integer, got {value!r}")
        if not errors:
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
        for name in ("qkv_bias", "tie_embeddings"):
            if not isinstance(getattr(self, name), bool):
                errors.append(f"model.{name}: expected true or false, got {getattr(self, name)!r}")
        if self.compute_dtype not in COMPUTE_DTYPES:
            errors.append(
                f"model.compute_dtype: expected one of {COMPUTE_DTYPES}, got {self.compute_dtype!r}"
            )
        if errors:
            raise ValueError("; ".join(errors))

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def dtype(self):
        return BF16 if self.compute_dtype == "bfloat16" else F32

    @classmethod
    def from_dict(cls, d: dict) -> LlamaConfig:
        """Build from :meth:`to_dict`'s form; unknown or missing keys are an error (named)."""
        d = {k: v for k, v in d.items() if k != "architecture"}
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"model: unknown keys {unknown}; expected a subset of {sorted(known)}")
        missing = sorted(
            f.name
            for f in dataclasses.fields(cls)
            if f.default is dataclasses.MISSING and f.name not in d
        )
        if missing:
            raise ValueError(f"model: missing required keys {missing}")
        return cls(**d)

    def to_dict(self) -> dict:
        return {"architecture": ARCHITECTURE, **dataclasses.asdict(self)}


# ----------------------------------------------------------------------------- parameters


def init_params(cfg: LlamaConfig, key) -> dict:
    """FP32 parameters: embeddings N(0, 0.02), matrices N(0, 1/fan_in) with the two residual
    writers (``wo``, ``w_down``) scaled by 1/sqrt(2 n_layers); biases 0, norm scales 1."""
    D, F, V, L = cfg.d_model, cfg.d_ff, cfg.vocab_size, cfg.n_layers
    HK, GK = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    keys = iter(jax.random.split(key, 2 + 7 * L))
    residual_scale = 1.0 / math.sqrt(2 * L)

    def normal(shape, std):
        return jax.random.normal(next(keys), shape, F32) * std

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


def _rms_norm(cfg: LlamaConfig, x_BxTxD, norm):
    """x / sqrt(mean(x^2) + eps) * scale, statistics in FP32."""
    x = x_BxTxD.astype(F32)
    mean_sq_BxTx1 = jnp.mean(jax.lax.square(x), axis=-1, keepdims=True)
    return (x * jax.lax.rsqrt(mean_sq_BxTx1 + cfg.norm_eps) * norm["scale"]).astype(cfg.dtype)


def _project(cfg: LlamaConfig, x_BxTxK, w_KxN, b_N=None):
    """x @ w (+ b added to the FP32 accumulator), rounded to the compute dtype."""
    y_BxTxN = _einsum(cfg, "btk,kn->btn", x_BxTxK, w_KxN, out_dtype=F32)
    if b_N is not None:
        y_BxTxN = y_BxTxN + b_N
    return y_BxTxN.astype(cfg.dtype)


def _attention(cfg: LlamaConfig, x_BxTxD, p, mask_Bx1xTxT, positions_BxT):
    B, T, _ = x_BxTxD.shape
    H, G, K = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    q_BxTxHxK = _project(cfg, x_BxTxD, p["wq"], p.get("bq")).reshape(B, T, H, K)
    k_BxTxGxK = _project(cfg, x_BxTxD, p["wk"], p.get("bk")).reshape(B, T, G, K)
    v_BxTxGxK = _project(cfg, x_BxTxD, p["wv"], p.get("bv")).reshape(B, T, G, K)
    q_BxTxHxK = _rotate(q_BxTxHxK, positions_BxT, cfg.rope_theta)
    k_BxTxGxK = _rotate(k_BxTxGxK, positions_BxT, cfg.rope_theta)
    # Grouped-query attention: query head h reads key/value head h // (H / G) (HF's repeat_kv).
    k_BxTxHxK = jnp.repeat(k_BxTxGxK, H // G, axis=2)
    v_BxTxHxK = jnp.repeat(v_BxTxGxK, H // G, axis=2)
    # Canonical 3-D [B*H, T, K] batched dots, as in model._attention (the fast XLA:CPU path).
    N = B * H
    q_NxTxK, k_NxTxK, v_NxTxK = (
        t.transpose(0, 2, 1, 3).reshape(N, T, K) for t in (q_BxTxHxK, k_BxTxHxK, v_BxTxHxK)
    )
    scores_NxTxT = _einsum(cfg, "ntk,nsk->nts", q_NxTxK, k_NxTxK, out_dtype=F32)
    scores_BxHxTxT = scores_NxTxT.reshape(B, H, T, T) * (K**-0.5)
    scores_BxHxTxT = jnp.where(mask_Bx1xTxT, scores_BxHxTxT, jnp.finfo(F32).min)
    probs_NxTxT = jax.nn.softmax(scores_BxHxTxT, axis=-1).astype(cfg.dtype).reshape(N, T, T)
    out_NxTxK = _einsum(cfg, "nts,nsk->ntk", probs_NxTxT, v_NxTxK)
    out_BxTxHK = out_NxTxK.reshape(B, H, T, K).transpose(0, 2, 1, 3).reshape(B, T, H * K)
    return _project(cfg, out_BxTxHK, p["wo"])


def _swiglu(cfg: LlamaConfig, x_BxTxD, p):
    gate_BxTxF = _einsum(cfg, "btd,df->btf", x_BxTxD, p["w_gate"], out_dtype=F32)
    up_BxTxF = _einsum(cfg, "btd,df->btf", x_BxTxD, p["w_up"], out_dtype=F32)
    act_BxTxF = (jax.nn.silu(gate_BxTxF) * up_BxTxF).astype(cfg.dtype)
    return _project(cfg, act_BxTxF, p["w_down"])


def forward(params, cfg: LlamaConfig, tokens_BxT, segments_BxT, positions_BxT):
    """Logits ``[B, T, V]`` (FP32) for every slot of a packed batch (see :func:`.model.forward`)."""
    h_BxTxD = params["embed"]["tokens"][tokens_BxT].astype(cfg.dtype)
    mask_Bx1xTxT = segment_mask(segments_BxT)
    for name in sorted(params["blocks"], key=int):
        block = params["blocks"][name]
        a_BxTxD = _rms_norm(cfg, h_BxTxD, block["attn_norm"])
        h_BxTxD = h_BxTxD + _attention(cfg, a_BxTxD, block["attn"], mask_Bx1xTxT, positions_BxT)
        a_BxTxD = _rms_norm(cfg, h_BxTxD, block["mlp_norm"])
        h_BxTxD = h_BxTxD + _swiglu(cfg, a_BxTxD, block["mlp"])
    h_BxTxD = _rms_norm(cfg, h_BxTxD, params["final_norm"])
    if cfg.tie_embeddings:
        return _einsum(cfg, "btd,vd->btv", h_BxTxD, params["embed"]["tokens"], out_dtype=F32)
    return _einsum(cfg, "btd,dv->btv", h_BxTxD, params["head"]["w"], out_dtype=F32)


def flops_per_token(cfg: LlamaConfig, seq_len: int) -> float:
    """6 x (matrix weights: q, o of D x H*K; k, v of D x G*K; 3 D x F; the D x V head)
    + 12 x layers x seq_len x H*K for attention scores and mixing."""
    D, F, L, V = cfg.d_model, cfg.d_ff, cfg.n_layers, cfg.vocab_size
    HK, GK = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    matmul_params = L * (2 * D * HK + 2 * D * GK + 3 * D * F) + D * V
    return float(6 * matmul_params + 12 * L * seq_len * HK)
