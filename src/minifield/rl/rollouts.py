"""Rollouts: G sampled completions of each prompt from the policy's key/value-cache generation,
every draw a pure function of (seed, update, prompt index, completion index).

Updates are numbered from 1, as everywhere a user sees them (the ``update`` event's ``step``,
the rollouts file ``update-{u:08d}.jsonl``, the checkpoint ``step-{u:08d}`` after it): update
``u`` draws with the policy after ``u - 1`` updates. Row ``r`` of an update's batch is
completion ``c`` of prompt ``p`` (the prompt's index in its split); its token at generation
step ``i`` of update ``u`` is drawn with the key
``fold_in(fold_in(fold_in(fold_in(fold_in(key(seed), u - 1), p), c), i)`` (``u - 1``: the
updates before it, so the runs recorded so far keep their draws) from the temperature-scaled
logits filtered by top-k and top-p exactly as :func:`minifield.models.sampling.filter_logits`
filters them (transformers' order). The draw never depends on which other rows share the
batch, so a resumed attempt regenerates the rollouts of the update it resumes at, whatever the
batch's composition or placement. Greedy (``sampling`` None) takes the argmax (ties to the
lowest id), for evaluation.

A completion ends with its first stop token (kept: the policy is trained to emit it) or after
``max_new`` tokens without one (truncated). The prompt occupies slots ``0 .. len - 1`` of a
row, the completion the slots after it; every prompt has at least one token. Only the Llama
family generates with a cache: a grpo recipe always has a base model, which is one.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from ..models import model
from ..models import sampling as sampling_rules
from ..models.execution import Execution


class Rollouts(NamedTuple):
    """An update's completions, ``N = prompts x G`` rows in prompt-major order."""

    prompt_index: np.ndarray  # [N] int: the prompt's row in its split
    completion_index: np.ndarray  # [N] int: 0 .. G - 1 within the prompt's group
    prompt_ids: list[list[int]]
    completion_ids: list[list[int]]  # the stop token included when there is one
    truncated: np.ndarray  # [N] bool: max_new tokens without a stop token


def row_keys(seed: int, update: int, prompt_index: np.ndarray, completion_index: np.ndarray):
    """The base key of each row of update ``update`` (1 for the first; see the module):
    ``[N]`` typed keys."""
    if update < 1:
        raise ValueError(f"updates are numbered from 1, got update {update}")
    # fold_in takes its data as uint32 whether it is a Python int or an array: the same bits
    return _row_keys(
        jax.random.key(seed),
        jnp.uint32(update - 1),
        jnp.asarray(prompt_index, jnp.uint32),
        jnp.asarray(completion_index, jnp.uint32),
    )


@jax.jit
def _row_keys(seed_key, before, prompt_index, completion_index):
    # compiled once per batch size: run op by op, the vmap would be traced anew every update
    key = jax.random.fold_in(seed_key, before)

    def one(p, c):
        return jax.random.fold_in(jax.random.fold_in(key, p), c)

    return jax.vmap(one)(prompt_index, completion_index)


def generate(
    params,
    cfg,
    prompt_ids: list[list[int]],
    max_new: int,
    stops: tuple[int, ...],
    *,
    sampling=None,
    seed: int = 0,
    update: int = 1,
    prompt_index=None,
    completion_index=None,
    length: int | None = None,
    row_sharding=None,
):
    """``(completion ids, truncated)`` of each row (see the module); ``sampling`` None is
    greedy. ``length``: the buffer's slots (a fixed value, with a fixed ``max_new``, keeps one
    compilation: the prompts run through the model over ``length - max_new`` slots; default
    the longest prompt plus ``max_new``, at most ``cfg.max_len``). ``row_sharding``: one that
    splits the rows over a data-parallel mesh (the rows must split evenly), for ``params``
    on that mesh: each device generates its own rows; None runs the rows where ``params``
    are. A row's draws are the same either way (its key is its own)."""
    rows = len(prompt_ids)
    prompt_index = np.arange(rows) if prompt_index is None else np.asarray(prompt_index)
    completion_index = (
        np.zeros(rows, np.int64) if completion_index is None else np.asarray(completion_index)
    )
    longest = max(len(p) for p in prompt_ids)
    length = length or min(cfg.max_len, longest + max_new)
    if longest + max_new > length:
        raise ValueError(f"a prompt of {longest} tokens and {max_new} new ones exceed {length}")
    buffer, lengths = model.prompt_buffer(prompt_ids, length)
    # generation runs the XLA attention over buffers of any length; no remat or loss chunks
    cfg = dataclasses.replace(cfg, execution=Execution())
    keys = row_keys(seed, update, prompt_index, completion_index)
    per_row = (jnp.asarray(buffer), jnp.asarray(lengths), keys)
    if row_sharding is not None:
        per_row = jax.device_put(per_row, row_sharding)
    buffer_BxL, lengths_B, keys_B = per_row
    choice = sampling_rules.Greedy()
    if sampling is not None:
        choice = sampling_rules.KeyedDraw(sampling, keys_B)
    out, out_lengths = model.decode(
        params,
        cfg,
        buffer_BxL,
        lengths_B,
        jnp.asarray(stops or (-1,), jnp.int32),
        jnp.int32(max_new),
        choice,
        length - max_new,
    )
    out, out_lengths = np.asarray(out), np.asarray(out_lengths)
    completions, truncated = [], np.zeros(rows, bool)
    for row, prompt in enumerate(prompt_ids):
        new = out[row, len(prompt) : out_lengths[row]].tolist()
        completions.append(new)
        truncated[row] = not (new and new[-1] in stops)
    return completions, truncated


def sample_groups(
    params, cfg, prompts: list[list[int]], prompt_index, G: int, **kwargs
) -> Rollouts:
    """G completions of each prompt (rows prompt-major: prompt 0's G, then prompt 1's, …)."""
    prompt_index = np.repeat(np.asarray(prompt_index), G)
    completion_index = np.tile(np.arange(G), len(prompts))
    prompt_ids = [p for p in prompts for _ in range(G)]
    completions, truncated = generate(
        params,
        cfg,
        prompt_ids,
        prompt_index=prompt_index,
        completion_index=completion_index,
        **kwargs,
    )
    return Rollouts(prompt_index, completion_index, prompt_ids, completions, truncated)
