"""The language model over packed rows, whichever its family: forward, losses, generation.

A packed row holds several examples one after another. Three int arrays of the
same shape ``[B, T]`` describe it:

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
    return _token_losses(params, cfg, batch, router=False)[0]


def _token_losses(params, cfg, batch, router: bool):
    """:func:`token_losses` and, with ``router``, the sparse layers' router logits
    ``[L, B * T, E]`` (else None)."""
    tokens_BxT = batch["tokens"]
    args = (params, cfg, tokens_BxT, batch["segments"], batch["positions"])
    h_BxTxD, logits_LxNxE = llama.hidden(*args, router=True) if router else (hidden(*args), None)
    targets_BxT = jnp.pad(tokens_BxT[:, 1:], ((0, 0), (0, 1)))
    logp_BxT, _ = target_logps(
        functools.partial(head, params, cfg), h_BxTxD, targets_BxT, cfg.execution.loss_chunk_tokens
    )
    return -logp_BxT, logits_LxNxE


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
        mask_N = (batch["segments"] != 0).reshape(-1)
        aux.update(router_loss.terms(cfg, logits_LxNxE, mask_N))
        loss = loss + aux["router_loss"]
    return loss, aux


# ----------------------------------------------------------------------------- generation


@functools.partial(jax.jit, static_argnums=(1,))
def _generate_rows(
    params, cfg: ModelConfig, buffer_BxL, max_new, lengths_B, stops_S, sampling, seed
):
    """Continuation of each row's prompt ``buffer[b, :lengths[b]]`` in place, each token
    chosen by :func:`.sampling.choose` (greedy when ``sampling`` is None).

    Each step runs the full forward over the fixed buffer (causality makes the slots
    after a row's end irrelevant to its next token) and writes one token per
    unfinished row; a row ends on any id of ``stops_S`` (``-1`` entries stop nothing).
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
        next_B = sampling_rules.choose(logits_BxLxV[rows_B, len_B - 1], sampling, seed, i)
        write_B = ~done_B
        buf_BxL = buf_BxL.at[rows_B, jnp.minimum(len_B, L - 1)].set(
            jnp.where(write_B, next_B, buf_BxL[rows_B, jnp.minimum(len_B, L - 1)])
        )
        len_B = len_B + write_B.astype(jnp.int32)
        done_B = done_B | (write_B & sampling_rules.is_stop(next_B, stops_S)) | (len_B >= L)
        return i + 1, buf_BxL, len_B, done_B

    done0_B = lengths_B >= L
    _, buf_BxL, len_B, _ = jax.lax.while_loop(
        cond, body, (jnp.int32(0), buffer_BxL, lengths_B, done0_B)
    )
    return buf_BxL, len_B


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

    ``cache``: a Llama model generates with a key/value cache (one single-position step per
    new token, :func:`.llama.generate_rows_cached`); ``False`` (or the GPT model) runs the
    full forward over the buffer for every token. Both give the same greedy tokens.

    The buffer length is rounded up to a multiple of 32 (at most ``cfg.max_len``) so
    that similar calls share one compilation (the token budget, stop tokens, sampling values
    and seed are traced values, not part of it).
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
    length = padded_length(longest + max_new_tokens, cfg.max_len)
    buffer = np.zeros((len(prompts), length), np.int32)
    for row, prompt in enumerate(prompts):
        buffer[row, : len(prompt)] = prompt
    lengths = np.asarray([len(p) for p in prompts], np.int32)
    stops = sampling_rules.stop_ids(stop_tokens)
    generate_rows = _generate_rows
    if cache and cfg.architecture == llama.ARCHITECTURE:
        generate_rows = llama.generate_rows_cached
    out, out_lengths = generate_rows(
        params,
        cfg,
        jnp.asarray(buffer),
        jnp.int32(max_new_tokens),
        jnp.asarray(lengths),
        jnp.asarray(stops or (-1,), jnp.int32),
        sampling,
        jnp.uint32(seed),
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
