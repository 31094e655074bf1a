"""Decoder-only transformer language model over packed rows.

A packed row holds several examples one after another. Three int arrays of the
same shape ``[B, T]`` describe it:

- ``tokens``: token ids;
- ``segments``: which example each slot belongs to (1, 2, ... within a row;
  0 marks padding);
- ``positions``: the position of the token inside its own example (restarting
  at 0 for every segment).

Attention is causal *and* restricted to the query's own segment (a
block-diagonal causal mask), and positions restart per segment, so an example
packed with others sees exactly what it would see alone in a row.

Precision: parameters are FP32 ("master" weights). With
``compute_dtype="bfloat16"`` the forward activations are BF16 and every matrix
product is a BF16 x BF16 dot accumulating in FP32 (``preferred_element_type``),
through a custom VJP whose backward dots are BF16 x BF16 -> FP32 as well:
autodiff of such a dot would otherwise produce FP32 backward dots, and XLA:CPU
only runs the BF16 x BF16 -> FP32 form on its fast (AMX-BF16) path. Weight
gradients leave the custom VJP in FP32 without a BF16 rounding. LayerNorm
statistics, the attention softmax, the logits and the loss are FP32.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from .execution import Execution

F32 = jnp.float32
BF16 = jnp.bfloat16

POSITION_KINDS = ("learned", "rotary")
COMPUTE_DTYPES = ("bfloat16", "float32")
LN_EPS = 1e-5
ROTARY_BASE = 10000.0


@dataclass(frozen=True)
class ModelConfig:
    """Architecture and precision. Hashable, so it can be a static argument of ``jax.jit``."""

    #: the GPT-style block of this module; ``llama.LlamaConfig`` selects the Llama block
    architecture: ClassVar[str] = "gpt"

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

    def __post_init__(self):
        errors = []
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "d_ff", "max_len"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                errors.append(f"model.{name}: expected a positive integer, got {value!r}")
        if not errors and self.d_model % self.n_heads:
            errors.append(
                f"model.d_model: {self.d_model} is not divisible by model.n_heads={self.n_heads}"
            )
        if self.positions not in POSITION_KINDS:
            errors.append(
                f"model.positions: expected one of {POSITION_KINDS}, got {self.positions!r}"
            )
        elif self.positions == "rotary" and not errors and (self.d_model // self.n_heads) % 2:
            errors.append(
                f"model.positions: rotary needs an even head size, got "
                f"d_model/n_heads = {self.d_model // self.n_heads}"
            )
        if not isinstance(self.tie_embeddings, bool):
            errors.append(
                f"model.tie_embeddings: expected true or false, got {self.tie_embeddings!r}"
            )
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
    def from_dict(cls, d: dict) -> ModelConfig:
        """Build from a recipe's ``model`` section; unknown keys are an error (named)."""
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
        out = dataclasses.asdict(self)
        del out["execution"]
        return out


def config_from_dict(d: dict):
    """The config a ``to_dict()`` form describes: Llama when it says so, else this module's."""
    if d.get("architecture") == "llama":
        from .llama import LlamaConfig

        return LlamaConfig.from_dict(d)
    return ModelConfig.from_dict(d)


# ----------------------------------------------------------------------------- parameters


def scaled_normal(key, shape, std: float):
    """N(0, std²) samples in FP32, with the same bits whether run op by op or inside one
    jit-compiled initialisation (the sharded one, see ``parallel.sharded_program``): without the
    barrier XLA folds ``std`` into the sampler's own constant factor (sqrt 2) when it sees
    both, which moves the last bit of some values and so the state hash."""
    return jax.lax.optimization_barrier(jax.random.normal(key, shape, F32)) * std


def init_params(cfg: ModelConfig, key) -> dict:
    """FP32 parameters as nested dicts with string keys.

    Embeddings N(0, 0.02); matrices N(0, 1/fan_in), with the two projections that write
    into the residual stream (``attn/wo``, ``mlp/w2``) scaled by 1/sqrt(2 n_layers) so the
    residual variance does not grow with depth; biases 0, LayerNorm scale 1.
    """
    if cfg.architecture == "llama":
        from . import llama

        return llama.init_params(cfg, key)
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


# ----------------------------------------------------------------------------- products


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _bf16_einsum(equation: str, out_dtype, a, b):
    """einsum of ``a`` and ``b`` rounded to BF16, accumulated in FP32, result in ``out_dtype``.

    The operands may be FP32 (master weights): they are rounded inside, and their
    gradients are returned in their own dtype straight from the FP32 accumulator.
    """
    return _bf16_einsum_fwd(equation, out_dtype, a, b)[0]


def _bf16_einsum_fwd(equation, out_dtype, a, b):
    a16, b16 = a.astype(BF16), b.astype(BF16)
    out = jnp.einsum(equation, a16, b16, preferred_element_type=F32).astype(out_dtype)
    # The dtypes of the original operands ride along as zero-size arrays (residuals must be
    # arrays), so the backward pass can return each gradient in its operand's dtype.
    return out, (a16, b16, jnp.zeros((0,), a.dtype), jnp.zeros((0,), b.dtype))


def _bf16_einsum_bwd(equation, out_dtype, residuals, g):
    a16, b16, a_proto, b_proto = residuals
    inputs, out = equation.split("->")
    spec_a, spec_b = inputs.split(",")
    g16 = g.astype(BF16)
    # The transposed-left products (dV = P^T dO, dK = dS^T Q) are still upcast to FP32 by
    # XLA:CPU (its fast path wants the left operand contracting on its last axis, and it
    # folds explicit transposes back into the dot); the weight gradients are not.
    da = jnp.einsum(f"{out},{spec_b}->{spec_a}", g16, b16, preferred_element_type=F32)
    db = jnp.einsum(f"{spec_a},{out}->{spec_b}", a16, g16, preferred_element_type=F32)
    return da.astype(a_proto.dtype), db.astype(b_proto.dtype)


_bf16_einsum.defvjp(_bf16_einsum_fwd, _bf16_einsum_bwd)


def _einsum(cfg: ModelConfig, equation: str, a, b, out_dtype=None):
    """The model's one matrix-product primitive (precision per ``cfg.compute_dtype``)."""
    out_dtype = cfg.dtype if out_dtype is None else out_dtype
    if cfg.compute_dtype == "float32":
        return jnp.einsum(equation, a, b).astype(out_dtype)
    return _bf16_einsum(equation, out_dtype, a, b)


def _dense(cfg: ModelConfig, x_BxTxK, w_KxN, b_N):
    """x @ w + b with the bias added to the FP32 accumulator before rounding to compute dtype."""
    y_BxTxN = _einsum(cfg, "btk,kn->btn", x_BxTxK, w_KxN, out_dtype=F32)
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


# ----------------------------------------------------------------------------- attention


def _rotate(x_BxTxHxK, positions_BxT, base: float = ROTARY_BASE, inv_freq_K2=None):
    """Rotary position embedding (rotate-half form), applied in FP32; ``inv_freq_K2``: the
    frequencies when not the plain ones of ``base`` (see :mod:`.rotary`)."""
    half = x_BxTxHxK.shape[-1] // 2
    if inv_freq_K2 is None:
        inv_freq_K2 = base ** (-jnp.arange(half, dtype=F32) / half)
    angle_BxTx1xK2 = (positions_BxT.astype(F32)[:, :, None] * inv_freq_K2)[:, :, None, :]
    cos, sin = jnp.cos(angle_BxTx1xK2), jnp.sin(angle_BxTx1xK2)
    x = x_BxTxHxK.astype(F32)
    x1, x2 = x[..., :half], x[..., half:]
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x_BxTxHxK.dtype)


def segment_mask(segments_BxT):
    """[B, 1, T, T] bool: query t may attend to key s iff s <= t and both share a segment.

    Padding slots (segment 0) attend to earlier padding only; their outputs carry no loss.
    Every query sees at least itself, so no softmax row is empty.
    """
    T = segments_BxT.shape[1]
    causal_TxT = jnp.tril(jnp.ones((T, T), dtype=bool))
    same_BxTxT = segments_BxT[:, :, None] == segments_BxT[:, None, :]
    return (same_BxTxT & causal_TxT)[:, None, :, :]


def _attention(cfg: ModelConfig, x_BxTxD, p, mask, positions_BxT):
    """``mask``: :func:`.attention.packed_mask`'s (the dense mask, or segment ids)."""
    from . import attention

    B, T, D = x_BxTxD.shape
    H, K = cfg.n_heads, cfg.head_dim
    qkv_BxTx3D = _dense(cfg, x_BxTxD, p["wqkv"], p["bqkv"])
    q_BxTxHxK, k_BxTxHxK, v_BxTxHxK = (
        t.reshape(B, T, H, K) for t in jnp.split(qkv_BxTx3D, 3, axis=-1)
    )
    if cfg.positions == "rotary":
        q_BxTxHxK = _rotate(q_BxTxHxK, positions_BxT)
        k_BxTxHxK = _rotate(k_BxTxHxK, positions_BxT)
    out_BxTxD = attention.mix(cfg, q_BxTxHxK, k_BxTxHxK, v_BxTxHxK, mask)
    return _dense(cfg, out_BxTxD, p["wo"], p["bo"])


# ----------------------------------------------------------------------------- model


def forward(params, cfg: ModelConfig, tokens_BxT, segments_BxT, positions_BxT):
    """Logits ``[B, T, V]`` (FP32) for every slot of a packed batch.

    ``positions`` must be < ``cfg.max_len`` with learned positions (a gather clamps
    larger indices silently); the packer's row length bounds them.
    """
    if cfg.architecture == "llama":
        from . import llama

        return llama.forward(params, cfg, tokens_BxT, segments_BxT, positions_BxT)
    return head(params, cfg, hidden(params, cfg, tokens_BxT, segments_BxT, positions_BxT))


def hidden(params, cfg: ModelConfig, tokens_BxT, segments_BxT, positions_BxT):
    """The residual stream after the last block ``[B, T, D]`` (compute dtype, before the
    final norm); :func:`head` turns it into logits."""
    from . import attention, layer_stack

    if cfg.architecture == "llama":
        from . import llama

        return llama.hidden(params, cfg, tokens_BxT, segments_BxT, positions_BxT)
    # Gather from the FP32 tables and round afterwards, so the embedding gradient is
    # scatter-added in FP32.
    h_BxTxD = params["embed"]["tokens"][tokens_BxT]
    if cfg.positions == "learned":
        h_BxTxD = h_BxTxD + params["embed"]["positions"][positions_BxT]
    h_BxTxD = h_BxTxD.astype(cfg.dtype)
    mask = attention.packed_mask(cfg, segments_BxT)

    def block_fn(block, h_BxTxD):
        a_BxTxD = _layer_norm(h_BxTxD, block["ln1"], cfg.dtype)
        # h + (f(x)) keeps the residual add outside the projection's fusion (faster on CPU).
        h_BxTxD = h_BxTxD + _attention(cfg, a_BxTxD, block["attn"], mask, positions_BxT)
        a_BxTxD = _layer_norm(h_BxTxD, block["ln2"], cfg.dtype)
        m = block["mlp"]
        u_BxTxF = jax.nn.gelu(_dense(cfg, a_BxTxD, m["w1"], m["b1"]))
        return h_BxTxD + _dense(cfg, u_BxTxF, m["w2"], m["b2"])

    names = layer_stack.layer_names(params["blocks"])
    return layer_stack.run_blocks(cfg.execution, params["blocks"], names, block_fn, h_BxTxD)


def head(params, cfg: ModelConfig, h_BxTxD):
    """FP32 logits ``[B, T, V]`` from :func:`hidden`'s states (final norm, output projection)."""
    if cfg.architecture == "llama":
        from . import llama

        return llama._head(params, cfg, h_BxTxD)
    h_BxTxD = _layer_norm(h_BxTxD, params["ln_f"], cfg.dtype)
    if cfg.tie_embeddings:
        return _einsum(cfg, "btd,vd->btv", h_BxTxD, params["embed"]["tokens"], out_dtype=F32)
    return _einsum(cfg, "btd,dv->btv", h_BxTxD, params["head"]["w"], out_dtype=F32)


def loss_weights(batch) -> jnp.ndarray:
    """``[B, T]`` float32: 1 where slot t has a next-token target that counts, else 0.

    Convention: the logits at slot t predict ``tokens[t + 1]``. That target counts
    iff ``loss_mask[t + 1] == 1`` (the *target* token is a response token) and
    ``segments[t] == segments[t + 1] != 0`` (it is the next token of the same
    example). The last slot of a row never has a target. (A 0/1 mask is expected;
    other values would act as per-target weights.)
    """
    seg_BxT = batch["segments"]
    same_BxT1 = (seg_BxT[:, :-1] == seg_BxT[:, 1:]) & (seg_BxT[:, :-1] != 0)
    w_BxT1 = jnp.where(same_BxT1, batch["loss_mask"][:, 1:].astype(F32), 0.0)
    return jnp.pad(w_BxT1, ((0, 0), (0, 1)))


def token_losses(params, cfg: ModelConfig, batch):
    """``[B, T]`` float32 next-token cross-entropy, *unmasked*.

    Slot t holds -log p(tokens[t + 1] | slots <= t of its segment); the last slot of
    each row holds the loss against token 0 (meaningless). Multiply by
    :func:`loss_weights` before summing.
    """
    tokens_BxT = batch["tokens"]
    if cfg.execution.loss_chunk_tokens:
        from .cross_entropy import chunked_token_losses

        h_BxTxD = hidden(params, cfg, tokens_BxT, batch["segments"], batch["positions"])
        return chunked_token_losses(
            functools.partial(head, params, cfg),
            h_BxTxD,
            jnp.pad(tokens_BxT[:, 1:], ((0, 0), (0, 1))),
            cfg.execution.loss_chunk_tokens,
        )
    logits_BxTxV = forward(params, cfg, tokens_BxT, batch["segments"], batch["positions"])
    targets_BxT = jnp.pad(tokens_BxT[:, 1:], ((0, 0), (0, 1)))
    logp_BxTxV = jax.nn.log_softmax(logits_BxTxV, axis=-1)
    return -jnp.take_along_axis(logp_BxTxV, targets_BxT[:, :, None], axis=-1)[:, :, 0]


def loss_fn(params, cfg: ModelConfig, batch):
    """Mean next-token loss over the counted targets of the batch (token-weighted).

    Returns ``(mean_loss, {"loss_sum": ..., "tokens": ...})``; see :func:`loss_weights`
    for which targets count. An all-padding batch has loss 0.
    """
    w_BxT = loss_weights(batch)
    loss_sum = jnp.sum(token_losses(params, cfg, batch) * w_BxT)
    tokens = jnp.sum(w_BxT)
    return loss_sum / jnp.maximum(tokens, 1.0), {"loss_sum": loss_sum, "tokens": tokens}


def flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Model FLOPs of one training token (forward + backward), for MFU.

    6 x (weights used in matrix products: 4 D^2 + 2 D F per layer, plus the D x V
    output projection) + attention scores and mixing: 12 x layers x seq_len x D
    (counted over the full, unmasked row, the usual convention).
    """
    if cfg.architecture == "llama":
        from . import llama

        return llama.flops_per_token(cfg, seq_len)
    D, F, L, V = cfg.d_model, cfg.d_ff, cfg.n_layers, cfg.vocab_size
    matmul_params = L * (4 * D * D + 2 * D * F) + D * V
    return float(6 * matmul_params + 12 * L * seq_len * D)


# ----------------------------------------------------------------------------- generation


@functools.partial(jax.jit, static_argnums=(1,))
def _generate_rows(params, cfg: ModelConfig, buffer_BxL, max_new, lengths_B, stop):
    """Greedy continuation of each row's prompt ``buffer[b, :lengths[b]]`` in place.

    Each step runs the full forward over the fixed buffer (causality makes the slots
    after a row's end irrelevant to its next token) and writes one token per
    unfinished row. ``stop < 0`` means no stop token.
    """
    B, L = buffer_BxL.shape
    segments_BxL = jnp.ones((B, L), jnp.int32)
    positions_BxL = jnp.broadcast_to(jnp.arange(L, dtype=jnp.int32), (B, L))
    rows_B = jnp.arange(B)

    def cond(carry):
        i, _, _, done_B = carry
        return (i < max_new) & ~jnp.all(done_B)

    def body(carry):
        i, buf_BxL, len_B, done_B = carry
        logits_BxLxV = forward(params, cfg, buf_BxL, segments_BxL, positions_BxL)
        next_B = jnp.argmax(logits_BxLxV[rows_B, len_B - 1], axis=-1).astype(jnp.int32)
        write_B = ~done_B
        buf_BxL = buf_BxL.at[rows_B, jnp.minimum(len_B, L - 1)].set(
            jnp.where(write_B, next_B, buf_BxL[rows_B, jnp.minimum(len_B, L - 1)])
        )
        len_B = len_B + write_B.astype(jnp.int32)
        done_B = done_B | (write_B & (next_B == stop)) | (len_B >= L)
        return i + 1, buf_BxL, len_B, done_B

    done0_B = lengths_B >= L
    _, buf_BxL, len_B, _ = jax.lax.while_loop(
        cond, body, (jnp.int32(0), buffer_BxL, lengths_B, done0_B)
    )
    return buf_BxL, len_B


def greedy_generate_batch(
    params,
    cfg: ModelConfig,
    prompts: list[list[int]],
    max_new_tokens: int,
    stop_token: int | None,
    cache: bool = True,
) -> list[list[int]]:
    """Greedy continuations of several prompts in one compiled loop (see :func:`greedy_generate`).

    ``cache``: a Llama model generates with a key/value cache (one single-position step per
    new token, :func:`.llama.generate_rows_cached`); ``False`` (or the GPT model) runs the
    full forward over the buffer for every token. Both give the same tokens.

    The buffer length is rounded up to a multiple of 32 (at most ``cfg.max_len``) so
    that similar calls share one compilation (the token budget and stop token are
    traced values, not part of it).
    """
    if not prompts:
        return []
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    longest = max(len(p) for p in prompts)
    if longest < 1:
        raise ValueError("every prompt needs at least one token")
    if longest > cfg.max_len:
        raise ValueError(f"a prompt has {longest} tokens, more than model.max_len={cfg.max_len}")
    for prompt in prompts:
        if len(prompt) < 1:
            raise ValueError("every prompt needs at least one token")
    if max_new_tokens == 0:
        return [[] for _ in prompts]
    # Generation runs buffers of any length through the XLA attention (the fused kernel wants
    # whole blocks) and needs no remat or loss chunks; a scanned stack stays scanned.
    cfg = dataclasses.replace(cfg, execution=Execution(scan_layers=cfg.execution.scan_layers))
    length = min(cfg.max_len, -(-(longest + max_new_tokens) // 32) * 32)
    buffer = np.zeros((len(prompts), length), np.int32)
    for row, prompt in enumerate(prompts):
        buffer[row, : len(prompt)] = prompt
    lengths = np.asarray([len(p) for p in prompts], np.int32)
    stop = -1 if stop_token is None else int(stop_token)
    generate_rows = _generate_rows
    if cache and cfg.architecture == "llama":
        from .llama import generate_rows_cached as generate_rows
    out, out_lengths = generate_rows(
        params,
        cfg,
        jnp.asarray(buffer),
        jnp.int32(max_new_tokens),
        jnp.asarray(lengths),
        jnp.int32(stop),
    )
    out, out_lengths = np.asarray(out), np.asarray(out_lengths)
    results = []
    for row, prompt in enumerate(prompts):
        new = out[row, len(prompt) : out_lengths[row]].tolist()
        if stop_token is not None and new and new[-1] == stop:
            new = new[:-1]
        results.append(new)
    return results


def greedy_generate(
    params,
    cfg: ModelConfig,
    prompt_tokens: list[int],
    max_new_tokens: int,
    stop_token: int | None,
    cache: bool = True,
) -> list[int]:
    """Greedy (argmax) continuation of one prompt: the new tokens only, prompt excluded.

    Stops after ``max_new_tokens`` tokens, when ``stop_token`` is produced (the stop
    token itself is not returned), or when prompt + continuation fill ``cfg.max_len``.
    Deterministic: argmax breaks ties by the lowest token id.
    """
    return greedy_generate_batch(
        params, cfg, [list(prompt_tokens)], max_new_tokens, stop_token, cache
    )[0]
