"""The language model over packed rows, whichever its family: forward, losses, generation.

A packed row holds several examples one after another. Three int arrays of the
same shape ``[B, T]`` describe it (the fields of a batch, :class:`minifield.data.packing.Rows`,
or of any batch with these fields, as preference's pairs):

- ``tokens``: token ids;
- ``segments``: which example each slot belongs to (1, 2, ... within a row;
  0 marks padding);
- ``positions``: the position of the token inside its own example (restarting
  at 0 for every segment).

Attention is causal *and* restricted to the query's own segment (a
block-diagonal causal mask, :func:`minifield.models.layers.attention.segment_mask`), and positions restart per
segment, so an example packed with others sees exactly what it would see alone in a row.

Two families compute it: the GPT-style block (:mod:`.gpt`, ``ModelConfig``) and the Llama
block (:mod:`.llama`, ``LlamaConfig``); a config's ``architecture`` selects one, and this
module dispatches to it. Precision (:mod:`minifield.models.layers.primitives`): parameters are FP32 ("master"
weights); with ``compute_dtype="bfloat16"`` the forward activations are BF16 and every matrix
product is a BF16 x BF16 dot accumulating in FP32. Norm statistics, the attention softmax,
the logits and the loss are FP32.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from . import gpt, llama, router_loss
from . import sampling as sampling_rules
from .cross_entropy import target_logps
from .execution import Execution
from .gpt import ModelConfig
from .layers.primitives import F32
from .sampling import Sampling


def _family(cfg):
    """The module that computes ``cfg``'s architecture."""
    return llama if cfg.architecture == llama.ARCHITECTURE else gpt


def config_from_dict(d: dict):
    """The config a ``to_dict()`` form describes: Llama when it says so, else GPT."""
    if d.get("architecture") == llama.ARCHITECTURE:
        return llama.LlamaConfig.from_dict(d)
    return ModelConfig.from_dict(d)


def init_params(cfg, key) -> dict:
    """FP32 parameters as nested dicts with string keys (the family's layout and draws)."""
    return _family(cfg).init_params(cfg, key)


def forward(params, cfg, tokens_BxT, segments_BxT, positions_BxT):
    """Logits ``[B, T, V]`` (FP32) for every slot of a packed batch.

    ``positions`` must be < ``cfg.max_len`` with learned positions (a gather clamps
    larger indices silently); the packer's row length bounds them.
    """
    return head(params, cfg, hidden(params, cfg, tokens_BxT, segments_BxT, positions_BxT))


def hidden(params, cfg, tokens_BxT, segments_BxT, positions_BxT):
    """The residual stream after the last block ``[B, T, D]`` (compute dtype, before the
    final norm); :func:`head` turns it into logits."""
    return _family(cfg).hidden(params, cfg, tokens_BxT, segments_BxT, positions_BxT)


def embed(params, cfg, tokens_BxT, positions_BxT):
    """The residual stream before the first layer ``[B, T, D]`` (compute dtype): what
    :func:`hidden` runs its layers over."""
    return _family(cfg).embed(params, cfg, tokens_BxT, positions_BxT)


def layer_window(cfg, index: int):
    """Layer ``index``'s sliding window (None: the whole segment), what :func:`layer` takes."""
    return cfg.layer_window(index) if cfg.architecture == llama.ARCHITECTURE else None


def layer(block, cfg, window, h_BxTxD, segments_BxT, positions_BxT):
    """One layer of :func:`hidden` alone, its parameters ``block`` and its ``window``
    (:func:`layer_window`): the same arithmetic, so running :func:`embed` and then every layer
    in order is :func:`hidden` (:mod:`.streamed` runs it so, a layer's weights at a time)."""
    return _family(cfg).layer(block, cfg, window, h_BxTxD, segments_BxT, positions_BxT)


def head(params, cfg, h_BxTxD):
    """FP32 logits ``[B, T, V]`` from :func:`hidden`'s states (final norm, output projection)."""
    return _family(cfg).head(params, cfg, h_BxTxD)


def flops_per_token(cfg, seq_len: int) -> float:
    """Model FLOPs of one training token (forward + backward), for MFU."""
    return _family(cfg).flops_per_token(cfg, seq_len)


def loss_weights(batch) -> jnp.ndarray:
    """``[B, T]`` float32: 1 where slot t has a next-token target that counts, else 0.

    Convention: the logits at slot t predict ``tokens[t + 1]``. That target counts
    iff ``loss_mask[t + 1] == 1`` (the *target* token is a response token) and
    ``segments[t] == segments[t + 1] != 0`` (it is the next token of the same
    example). The last slot of a row never has a target. (A 0/1 mask is expected;
    other values would act as per-target weights.)
    """
    seg_BxT = batch.segments
    same_BxT1 = (seg_BxT[:, :-1] == seg_BxT[:, 1:]) & (seg_BxT[:, :-1] != 0)
    w_BxT1 = jnp.where(same_BxT1, batch.loss_mask[:, 1:].astype(F32), 0.0)
    return jnp.pad(w_BxT1, ((0, 0), (0, 1)))


def token_losses(params, cfg: ModelConfig, batch):
    """``[B, T]`` float32 next-token cross-entropy, *unmasked*.

    Slot t holds -log p(tokens[t + 1] | slots <= t of its segment); the last slot of
    each row holds the loss against token 0 (meaningless). Multiply by
    :func:`loss_weights` before summing.
    """
    return _token_losses(params, cfg, batch, router=False)[0]


def _token_losses(params, cfg, batch, router: bool):
    """:func:`token_losses` and, with ``router``, the sparse layers' router logits
    ``[L, B * T, E]`` (else None)."""
    args = (params, cfg, batch.tokens, batch.segments, batch.positions)
    h_BxTxD, logits_LxNxE = llama.hidden(*args, router=True) if router else (hidden(*args), None)
    return hidden_losses(params, cfg, h_BxTxD, batch.tokens), logits_LxNxE


def hidden_losses(params, cfg, h_BxTxD, tokens_BxT):
    """:func:`token_losses` from :func:`hidden`'s states (the head's parameters suffice)."""
    targets_BxT = jnp.pad(tokens_BxT[:, 1:], ((0, 0), (0, 1)))
    logp_BxT, _ = target_logps(
        functools.partial(head, params, cfg), h_BxTxD, targets_BxT, cfg.execution.loss_chunk_tokens
    )
    return -logp_BxT


def loss_fn(params, cfg: ModelConfig, batch):
    """Mean next-token loss over the counted targets of the batch (token-weighted).

    Returns ``(mean_loss, {"loss_sum": ..., "tokens": ...})``; see :func:`loss_weights`
    for which targets count. An all-padding batch has loss 0. A mixture of experts trained
    with the router's losses (:func:`.router_loss.enabled`) adds ``router_loss`` to the mean
    (``loss_sum`` stays the language model's) and returns :func:`.router_loss.terms` in the
    dict, its mask the rows' ``segments != 0``.
    """
    w_BxT = loss_weights(batch)
    router = router_loss.enabled(cfg)
    losses_BxT, logits_LxNxE = _token_losses(params, cfg, batch, router)
    loss_sum = jnp.sum(losses_BxT * w_BxT)
    tokens = jnp.sum(w_BxT)
    loss, aux = loss_sum / jnp.maximum(tokens, 1.0), {"loss_sum": loss_sum, "tokens": tokens}
    if router:
        mask_N = (batch.segments != 0).reshape(-1)
        aux.update(router_loss.terms(cfg, logits_LxNxE, mask_N))
        loss = loss + aux["router_loss"]
    return loss, aux


# ----------------------------------------------------------------------------- generation


@functools.partial(jax.jit, static_argnums=(1, 7))
def decode(params, cfg, buffer_BxL, lengths_B, stops_S, max_new, choice, prefill=None):
    """Each row's prompt ``buffer[b, :lengths[b]]`` continued in place: the one decode loop.

    Each step writes one token to every unfinished row, ``choice(logits_BxV, step)``'s (a
    token choice of :mod:`.sampling`: greedy or a draw); a row ends with its first stop
    token (written; ``-1`` entries of ``stops_S`` stop nothing), when it fills the buffer (a
    prompt that fills it takes no token), or after ``max_new`` steps. Returns the buffer and
    each row's length. Every prompt has at least one token (:func:`prompt_buffer` refuses an
    empty one): the logits at its last slot choose the first new token.

    ``prefill`` None runs the full forward over the buffer for every token (any family;
    causality makes the slots after a row's end irrelevant to its next token). An int is
    Llama's key/value cache: the first ``prefill`` slots (at least the longest prompt) run
    through the model once, then each token costs one single-position step; the width
    changes no token (no query reads a slot before its token is written), only the shapes
    compiled.
    """
    B, L = buffer_BxL.shape
    rows_B = jnp.arange(B)
    if prefill is None:
        segments_BxL = jnp.ones((B, L), jnp.int32)
        positions_BxL = jnp.broadcast_to(jnp.arange(L, dtype=jnp.int32), (B, L))

        def logits_after(state, buf_BxL, last_B):
            logits_BxLxV = forward(params, cfg, buf_BxL, segments_BxL, positions_BxL)
            return logits_BxLxV[rows_B, last_B], state

        logits_BxV, state = logits_after(None, buffer_BxL, lengths_B - 1)
    else:
        positions_BxW = jnp.broadcast_to(jnp.arange(prefill, dtype=jnp.int32), (B, prefill))
        logits_BxV, state = llama.forward_cached(
            params,
            cfg,
            buffer_BxL[:, :prefill],
            positions_BxW,
            llama.empty_cache(cfg, B, L),
            lengths_B - 1,
        )

        def logits_after(cache, buf_BxL, last_B):
            # the token just written (a finished row rewrites its last slot with the same values)
            token_Bx1 = buf_BxL[rows_B, last_B][:, None]
            return llama.forward_cached(
                params, cfg, token_Bx1, last_B[:, None], cache, jnp.zeros((B,), jnp.int32)
            )

    def cond(carry):
        i, _, _, done_B, _, _ = carry
        return (i < max_new) & ~jnp.all(done_B)

    def body(carry):
        i, buf_BxL, len_B, done_B, logits_BxV, state = carry
        next_B = choice(logits_BxV, i)
        write_B = ~done_B
        slot_B = jnp.minimum(len_B, L - 1)
        buf_BxL = buf_BxL.at[rows_B, slot_B].set(
            jnp.where(write_B, next_B, buf_BxL[rows_B, slot_B])
        )
        len_B = len_B + write_B.astype(jnp.int32)
        done_B = done_B | (write_B & sampling_rules.is_stop(next_B, stops_S)) | (len_B >= L)
        logits_BxV, state = logits_after(state, buf_BxL, jnp.minimum(len_B - 1, L - 1))
        return i + 1, buf_BxL, len_B, done_B, logits_BxV, state

    carry = (jnp.int32(0), buffer_BxL, lengths_B, lengths_B >= L, logits_BxV, state)
    _, buf_BxL, len_B, _, _, _ = jax.lax.while_loop(cond, body, carry)
    return buf_BxL, len_B


def prompt_buffer(prompts: list[list[int]], length: int) -> tuple[np.ndarray, np.ndarray]:
    """The ``[B, length]`` int32 buffer :func:`decode` continues (each prompt from slot 0, 0
    after it) and the prompts' lengths; an empty prompt is refused (no logits choose its
    first token: the model has no start of its own)."""
    if any(len(prompt) < 1 for prompt in prompts):
        raise ValueError("every prompt needs at least one token")
    buffer = np.zeros((len(prompts), length), np.int32)
    for row, prompt in enumerate(prompts):
        buffer[row, : len(prompt)] = prompt
    return buffer, np.asarray([len(prompt) for prompt in prompts], np.int32)


#: buffers and scored rows are padded to a multiple of this many positions, so that calls of
#: nearby lengths share one compiled program
ROW_QUANTUM = 32


def padded_length(length: int, max_len: int) -> int:
    """``length`` rounded up to a multiple of :data:`ROW_QUANTUM`, at most ``max_len``."""
    return min(max_len, -(-length // ROW_QUANTUM) * ROW_QUANTUM)


def generate_batch(
    params,
    cfg: ModelConfig,
    prompts: list[list[int]],
    max_new_tokens: int,
    stop_tokens: int | Sequence[int] | None,
    cache: bool = True,
    sampling: Sampling | None = None,
    seed: int = 0,
) -> list[list[int]]:
    """Continuations of several prompts in one compiled loop: the new tokens only.

    Each stops after ``max_new_tokens`` tokens, when it produces any of ``stop_tokens`` (an
    id, several, or None; the stop token itself is not returned), or when prompt +
    continuation fill ``cfg.max_len``. ``sampling`` None is greedy (argmax, ties to the
    lowest id); otherwise each token is drawn as :mod:`.sampling` says, from ``seed``.

    ``cache``: a Llama model generates with :func:`decode`'s key/value cache (one
    single-position step per new token); ``False`` (or the GPT model) runs the full forward
    over the buffer for every token. Both give the same greedy tokens.

    The buffer length is rounded up to a multiple of 32 (at most ``cfg.max_len``) so
    that similar calls share one compilation (the token budget, stop tokens, sampling values
    and seed are traced values, not part of it).
    """
    if not prompts:
        return []
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    longest = max(len(p) for p in prompts)
    if longest > cfg.max_len:
        raise ValueError(f"a prompt has {longest} tokens, more than model.max_len={cfg.max_len}")
    length = padded_length(longest + max_new_tokens, cfg.max_len)
    buffer, lengths = prompt_buffer(prompts, length)
    if max_new_tokens == 0:
        return [[] for _ in prompts]
    # Generation runs buffers of any length through the XLA attention (the fused kernel wants
    # whole blocks) and needs no remat or loss chunks; a scanned stack stays scanned.
    cfg = dataclasses.replace(cfg, execution=Execution(scan_layers=cfg.execution.scan_layers))
    stops = sampling_rules.stop_ids(stop_tokens)
    cached = cache and cfg.architecture == llama.ARCHITECTURE
    out, out_lengths = decode(
        params,
        cfg,
        jnp.asarray(buffer),
        jnp.asarray(lengths),
        jnp.asarray(stops or (-1,), jnp.int32),
        jnp.int32(max_new_tokens),
        sampling_rules.choice(sampling, jnp.uint32(seed)),
        length if cached else None,
    )
    out, out_lengths = np.asarray(out), np.asarray(out_lengths)
    results = []
    for row, prompt in enumerate(prompts):
        new = out[row, len(prompt) : out_lengths[row]].tolist()
        if new and new[-1] in stops:
            new = new[:-1]
        results.append(new)
    return results


def greedy_generate_batch(params, cfg, prompts, max_new_tokens, stop_token, cache=True):
    """Greedy continuations of several prompts (:func:`generate_batch` without sampling)."""
    return generate_batch(params, cfg, prompts, max_new_tokens, stop_token, cache)


def greedy_generate(
    params,
    cfg: ModelConfig,
    prompt_tokens: list[int],
    max_new_tokens: int,
    stop_token: int | Sequence[int] | None,
    cache: bool = True,
) -> list[int]:
    """Greedy (argmax) continuation of one prompt: the new tokens only, prompt excluded.

    Stops after ``max_new_tokens`` tokens, when ``stop_token`` (or any of several) is
    produced (the stop token itself is not returned), or when prompt + continuation fill
    ``cfg.max_len``. Deterministic: argmax breaks ties by the lowest token id.
    """
    return generate_batch(params, cfg, [list(prompt_tokens)], max_new_tokens, stop_token, cache)[0]
