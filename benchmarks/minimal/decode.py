"""A minimal JAX key/value-cache sampling loop of the Llama model, the baseline
``grpo_rollouts.py`` measures ``minifield.rl.rollouts.sample_groups`` against.

Plain ``jnp``: embed, RMSNorm, rotary, GQA attention against a ``[B, S, G, K]`` cache
(key/value heads repeated), SwiGLU, head; the prompt through the model once, then a
``lax.fori_loop`` of one position per token, the cache written with ``dynamic_update_slice``
(every row at the same slot), the token drawn by ``jax.random.categorical`` from ``logits /
temperature`` with one key per step; the parameters cast to the compute dtype once before
the loop.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

F32 = jnp.float32
#: Llama-3.2-1B's rotary base and RMSNorm epsilon (its widths are the arguments' defaults)
THETA, EPS = 500000.0, 1e-5


class Heads(NamedTuple):
    """The attention's widths, what the minimal loop needs besides the parameters' shapes."""

    n: int
    kv: int
    dim: int


def minimal_params(params: dict, dtype) -> dict:
    """minifield's parameter tree as this loop's: matrices in the compute dtype, norm scales
    FP32 (as minifield multiplies them); the embedding table stays FP32 (its rows are cast
    when gathered: casting the whole table would cost a pass over it per call)."""

    def cast(w):
        return w.astype(dtype)

    return {
        "emb": params["embed"]["tokens"],
        "layers": [
            {
                "ln1": b["attn_norm"]["scale"],
                "ln2": b["mlp_norm"]["scale"],
                **{k: cast(b["attn"][k]) for k in ("wq", "wk", "wv", "wo")},
                "wg": cast(b["mlp"]["w_gate"]),
                "wu": cast(b["mlp"]["w_up"]),
                "wd": cast(b["mlp"]["w_down"]),
            }
            for _, b in sorted(params["blocks"].items())
        ],
        "norm": params["final_norm"]["scale"],
        "head": cast(params["head"]["w"]),
    }


def _dot(eq, a, b, out):
    return jnp.einsum(eq, a, b, preferred_element_type=F32).astype(out)


def _rms(x, scale, dtype):
    x = x.astype(F32)
    return (x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + EPS) * scale).astype(dtype)


def _rope(x, pos_BxT):
    half = x.shape[-1] // 2
    inv = THETA ** (-jnp.arange(half, dtype=F32) / half)
    angle = (pos_BxT.astype(F32)[:, :, None] * inv)[:, :, None, :]
    cos, sin = jnp.cos(angle), jnp.sin(angle)
    x1, x2 = x[..., :half].astype(F32), x[..., half:].astype(F32)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).astype(x.dtype)


def _forward(p, heads: Heads, tokens_BxT, start, cache, dtype):
    """Positions ``start .. start + T - 1`` of every row: their keys and values written into
    ``cache`` (``[layers, 2, B, S, G, K]``), each query against the cache slots at or before
    it; returns the logits of the last position ``[B, V]`` (FP32) and the cache."""
    B, T = tokens_BxT.shape
    S = cache.shape[3]
    H, G, K = heads
    pos_BxT = jnp.broadcast_to(start + jnp.arange(T, dtype=jnp.int32), (B, T))
    mask_Bx1xTxS = (jnp.arange(S)[None, None, :] <= pos_BxT[:, :, None])[:, None]
    h = p["emb"][tokens_BxT].astype(dtype)
    for i, w in enumerate(p["layers"]):
        x = _rms(h, w["ln1"], dtype)
        q = _rope(_dot("btd,dn->btn", x, w["wq"], dtype).reshape(B, T, H, K), pos_BxT)
        k = _rope(_dot("btd,dn->btn", x, w["wk"], dtype).reshape(B, T, G, K), pos_BxT)
        v = _dot("btd,dn->btn", x, w["wv"], dtype).reshape(B, T, G, K)
        at = (0, 0, start, 0, 0)
        cache = jax.lax.dynamic_update_slice(cache, k[None, None], (i, *at))
        cache = jax.lax.dynamic_update_slice(cache, v[None, None], (i, 1, *at[1:]))
        ks, vs = (jnp.repeat(cache[i, j], H // G, axis=2) for j in (0, 1))
        qn = q.transpose(0, 2, 1, 3).reshape(B * H, T, K)
        kn, vn = (t.transpose(0, 2, 1, 3).reshape(B * H, S, K) for t in (ks, vs))
        s = _dot("ntk,nsk->nts", qn, kn, F32).reshape(B, H, T, S) * K**-0.5
        a = jax.nn.softmax(jnp.where(mask_Bx1xTxS, s, jnp.finfo(F32).min), -1)
        o = _dot("nts,nsk->ntk", a.astype(dtype).reshape(B * H, T, S), vn, dtype)
        o = o.reshape(B, H, T, K).transpose(0, 2, 1, 3).reshape(B, T, H * K)
        h = h + _dot("btn,nd->btd", o, w["wo"], dtype)
        x = _rms(h, w["ln2"], dtype)
        g = _dot("btd,df->btf", x, w["wg"], F32)
        u = _dot("btd,df->btf", x, w["wu"], F32)
        h = h + _dot("btf,fd->btd", (jax.nn.silu(g) * u).astype(dtype), w["wd"], dtype)
    logits = _dot("bd,dv->bv", _rms(h[:, -1], p["norm"], dtype), p["head"], F32)
    return logits, cache


@functools.partial(jax.jit, static_argnums=(1, 4, 5, 6))
def minimal_generate(params, heads: Heads, prompt_BxP, key, new, temperature, dtype_name):
    """``[B, new]`` tokens after each prompt (``temperature`` None: greedy)."""
    dtype = jnp.dtype(dtype_name)
    p = minimal_params(params, dtype)
    B, P = prompt_BxP.shape
    cache = jnp.zeros((len(p["layers"]), 2, B, P + new, heads.kv, heads.dim), dtype)
    logits, cache = _forward(p, heads, prompt_BxP, 0, cache, dtype)

    def step(i, carry):
        out_BxN, logits, cache = carry
        if temperature is None:
            token_B = jnp.argmax(logits, -1).astype(jnp.int32)
        else:
            draw = jax.random.fold_in(key, i)
            token_B = jax.random.categorical(draw, logits / temperature).astype(jnp.int32)
        out_BxN = jax.lax.dynamic_update_slice(out_BxN, token_B[:, None], (0, i))
        logits, cache = _forward(p, heads, token_B[:, None], P + i, cache, dtype)
        return out_BxN, logits, cache

    out = jnp.zeros((B, new), jnp.int32)
    return jax.lax.fori_loop(0, new, step, (out, logits, cache))[0]
