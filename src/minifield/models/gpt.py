"""The GPT-style decoder block (``model.architecture`` absent or ``gpt``) over packed rows.

Pre-LayerNorm blocks (LayerNorm with FP32 statistics, fused q/k/v projection with biases,
GELU MLP), learned or rotary positions, an output head tied to the token embedding or
separate. The packed-row contracts and precision are :mod:`.model`'s; every matrix product
goes through :func:`minifield.models.layers.primitives.einsum`.

Parameters (``[in, out]`` matrices)::

    embed/tokens [V, D], embed/positions [max_len, D] (learned positions only)
    blocks/NN/ln1/{scale, bias} [D]
    blocks/NN/attn/{wqkv [D, 3D], bqkv [3D], wo [D, D], bo [D]}
    blocks/NN/ln2/{scale, bias} [D]
    blocks/NN/mlp/{w1 [D, F], b1 [F], w2 [F, D], b2 [D]}
    ln_f/{scale, bias} [D]
    head/w [D, V]  (untied only)
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp

from .execution import Execution
from .layers import attention, layer_stack
from .layers.architecture import ArchitectureConfig
from .layers.primitives import F32, einsum, rotate, scaled_normal

POSITION_KINDS = ("learned", "rotary")
LN_EPS = 1e-5


@dataclass(frozen=True)
class ModelConfig(ArchitectureConfig):
    """Architecture and precision. Hashable, so it can be a static argument of ``jax.jit``."""

    #: the GPT-style block of this module; ``llama.LlamaConfig`` selects the Llama block
    architecture = "gpt"
    INTEGER_FIELDS = ("vocab_size", "d_model", "n_layers", "n_heads", "d_ff", "max_len")
    FLAG_FIELDS = ("tie_embeddings",)

    vocab_size: int
    d_model: int
    n_layers: int
    n_heads: int
    d_ff: int
    max_len: int
    positions: str = "learned"  # "learned" (a table of max_len rows) or "rotary"
    tie_embeddings: bool = True  # output projection = token embedding transposed
    compute_dtype: str = "bfloat16"  # "bfloat16" or "float32"
    #: how it computes (attention kernel, scan, remat, loss chunks): not architecture, so
    #: ``to_dict`` leaves it out (see :mod:`.execution`)
    execution: Execution = Execution()

    def architecture_errors(self, sizes_valid: bool) -> list[str]:
        errors = []
        if sizes_valid and self.d_model % self.n_heads:
            errors.append(
                f"model.d_model: {self.d_model} is not divisible by model.n_heads={self.n_heads}"
            )
        if self.positions not in POSITION_KINDS:
            errors.append(
                f"model.positions: expected one of {POSITION_KINDS}, got {self.positions!r}"
            )
        elif self.positions == "rotary" and sizes_valid and not errors and self.head_dim % 2:
            errors.append(
                f"model.positions: rotary needs an even head size, got "
                f"d_model/n_heads = {self.head_dim}"
            )
        return errors


def init_params(cfg: ModelConfig, key) -> dict:
    """FP32 parameters as nested dicts with string keys.

    Embeddings N(0, 0.02); matrices N(0, 1/fan_in), with the two projections that write
    into the residual stream (``attn/wo``, ``mlp/w2``) scaled by 1/sqrt(2 n_layers) so the
    residual variance does not grow with depth; biases 0, LayerNorm scale 1.
    """
    D, F, V, L = cfg.d_model, cfg.d_ff, cfg.vocab_size, cfg.n_layers
    keys = iter(jax.random.split(key, 4 + 4 * L))
    residual_scale = 1.0 / math.sqrt(2 * L)

    def normal(shape, std):
        return scaled_normal(next(keys), shape, std)

    def norm():
        return {"scale": jnp.ones((D,), F32), "bias": jnp.zeros((D,), F32)}

    embed = {"tokens": normal((V, D), 0.02)}
    if cfg.positions == "learned":
        embed["positions"] = normal((cfg.max_len, D), 0.02)
    params: dict[str, Any] = {"embed": embed, "blocks": {}, "ln_f": norm()}
    for i in range(L):
        params["blocks"][f"{i:02d}"] = {
            "ln1": norm(),
            "attn": {
                "wqkv": normal((D, 3 * D), D**-0.5),
                "bqkv": jnp.zeros((3 * D,), F32),
                "wo": normal((D, D), D**-0.5 * residual_scale),
                "bo": jnp.zeros((D,), F32),
            },
            "ln2": norm(),
            "mlp": {
                "w1": normal((D, F), D**-0.5),
                "b1": jnp.zeros((F,), F32),
                "w2": normal((F, D), F**-0.5 * residual_scale),
                "b2": jnp.zeros((D,), F32),
            },
        }
    if not cfg.tie_embeddings:
        params["head"] = {"w": normal((D, V), D**-0.5)}
    return params


def _dense(cfg: ModelConfig, x_BxTxK, w_KxN, b_N):
    """x @ w + b with the bias added to the FP32 accumulator before rounding to compute dtype."""
    y_BxTxN = einsum(cfg, "btk,kn->btn", x_BxTxK, w_KxN, out_dtype=F32)
    return (y_BxTxN + b_N).astype(cfg.dtype)


def _layer_norm(x_BxTxD, norm, dtype):
    """LayerNorm with FP32 statistics.

    mean(square(x)) is formed before mean(x): on XLA:CPU this order fuses better
    (a measurably faster step) than the textbook mean -> (x - mean)^2 form.
    """
    x = x_BxTxD.astype(F32)
    mean_sq_BxTx1 = jnp.mean(jax.lax.square(x), axis=-1, keepdims=True)
    mean_BxTx1 = jnp.mean(x, axis=-1, keepdims=True)
    var_BxTx1 = jnp.maximum(mean_sq_BxTx1 - jax.lax.square(mean_BxTx1), 0.0)
    y = (x - mean_BxTx1) * (jax.lax.rsqrt(var_BxTx1 + LN_EPS) * norm["scale"]) + norm["bias"]
    return y.astype(dtype)


def _attention(cfg: ModelConfig, x_BxTxD, p, mask, positions_BxT):
    """``mask``: :func:`minifield.models.layers.attention.packed_mask`'s (the dense mask, or segment ids)."""
    B, T, D = x_BxTxD.shape
    H, K = cfg.n_heads, cfg.head_dim
    qkv_BxTx3D = _dense(cfg, x_BxTxD, p["wqkv"], p["bqkv"])
    q_BxTxHxK, k_BxTxHxK, v_BxTxHxK = (
        t.reshape(B, T, H, K) for t in jnp.split(qkv_BxTx3D, 3, axis=-1)
    )
    if cfg.positions == "rotary":
        q_BxTxHxK = rotate(q_BxTxHxK, positions_BxT)
        k_BxTxHxK = rotate(k_BxTxHxK, positions_BxT)
    out_BxTxD = attention.mix(cfg, q_BxTxHxK, k_BxTxHxK, v_BxTxHxK, mask)
    return _dense(cfg, out_BxTxD, p["wo"], p["bo"])


def hidden(params, cfg: ModelConfig, tokens_BxT, segments_BxT, positions_BxT):
    """The residual stream after the last block ``[B, T, D]`` (compute dtype, before the
    final norm); :func:`head` turns it into logits."""
    h_BxTxD = embed(params, cfg, tokens_BxT, positions_BxT)
    mask = attention.packed_mask(cfg, segments_BxT)

    def block_fn(block, h_BxTxD):
        return _block(cfg, block, h_BxTxD, mask, positions_BxT)

    names = layer_stack.layer_names(params["blocks"])
    return layer_stack.run_blocks(cfg.execution, params["blocks"], names, block_fn, h_BxTxD)


def embed(params, cfg: ModelConfig, tokens_BxT, positions_BxT):
    """The residual stream before the first block (:func:`.model.embed`)."""
    # Gather from the FP32 tables and round afterwards, so the embedding gradient is
    # scatter-added in FP32.
    h_BxTxD = params["embed"]["tokens"][tokens_BxT]
    if cfg.positions == "learned":
        h_BxTxD = h_BxTxD + params["embed"]["positions"][positions_BxT]
    return h_BxTxD.astype(cfg.dtype)


def _block(cfg: ModelConfig, block, h_BxTxD, mask, positions_BxT):
    a_BxTxD = _layer_norm(h_BxTxD, block["ln1"], cfg.dtype)
    # h + (f(x)) keeps the residual add outside the projection's fusion (faster on CPU).
    h_BxTxD = h_BxTxD + _attention(cfg, a_BxTxD, block["attn"], mask, positions_BxT)
    a_BxTxD = _layer_norm(h_BxTxD, block["ln2"], cfg.dtype)
    m = block["mlp"]
    u_BxTxF = jax.nn.gelu(_dense(cfg, a_BxTxD, m["w1"], m["b1"]))
    return h_BxTxD + _dense(cfg, u_BxTxF, m["w2"], m["b2"])


def layer(block, cfg: ModelConfig, window, h_BxTxD, segments_BxT, positions_BxT):
    """One block alone (:func:`.model.layer`), as :func:`hidden` runs it."""
    del window  # no sliding windows here
    return _block(cfg, block, h_BxTxD, attention.packed_mask(cfg, segments_BxT), positions_BxT)


def head(params, cfg: ModelConfig, h_BxTxD):
    """FP32 logits ``[B, T, V]`` from :func:`hidden`'s states (final norm, output projection)."""
    h_BxTxD = _layer_norm(h_BxTxD, params["ln_f"], cfg.dtype)
    if cfg.tie_embeddings:
        return einsum(cfg, "btd,vd->btv", h_BxTxD, params["embed"]["tokens"], out_dtype=F32)
    return einsum(cfg, "btd,dv->btv", h_BxTxD, params["head"]["w"], out_dtype=F32)


def flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Model FLOPs of one training token (forward + backward), for MFU.

    6 x (weights used in matrix products: 4 D^2 + 2 D F per layer, plus the D x V
    output projection) + attention scores and mixing: 12 x layers x seq_len x D
    (counted over the full, unmasked row, the usual convention).
    """
    D, F, L, V = cfg.d_model, cfg.d_ff, cfg.n_layers, cfg.vocab_size
    matmul_params = L * (4 * D * D + 2 * D * F) + D * V
    return float(6 * matmul_params + 12 * L * seq_len * D)
