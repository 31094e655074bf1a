"""The forward run a layer's weights at a time, over every row it is asked for.

A model too large for memory (an 8B export: 32 GB of FP32 parameters) is still evaluated in
memory bounded by one layer: the embedding, then each layer's weights placed just before
that layer runs over all the rows (the residual streams of every row kept between layers),
then the final norm, the head and the loss. Each piece is :mod:`.model`'s own
(:func:`~.model.embed`, :func:`~.model.layer`, :func:`~.model.hidden_losses`), the
arithmetic of :func:`~.model.hidden` split where one layer ends and the next begins.

What gives the weights is a :class:`Weights`: :class:`minifield.hf.directory.LayerFiles`
reads an export's, a part at a time, from its memory-mapped safetensors files.
The parameters outside the layers (embedding, final norm, head) are held for the whole run;
a layer's only while it runs. Greedy generation (:meth:`Streamed.greedy`) runs the full
forward over each buffer for each new token, as :func:`.model.decode` without a cache does,
every buffer at once: every layer's weights once per token.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple, Protocol

import jax
import jax.numpy as jnp
import numpy as np

from . import model
from . import sampling as sampling_rules
from .execution import Execution


class Weights(Protocol):
    """A model's parameters, a part at a time."""

    def outer(self) -> dict:
        """Every parameter outside the layers: the embedding, the final norm, the head."""

    def layer(self, index: int) -> dict:
        """Layer ``index``'s parameters (its block)."""


class Rows(NamedTuple):
    """What the forward reads of a batch (a :class:`minifield.data.packing.Rows` has more)."""

    tokens: np.ndarray
    segments: np.ndarray
    positions: np.ndarray


class Streamed:
    """The forward of ``cfg`` a layer at a time, each piece compiled once per shape."""

    def __init__(self, cfg):
        self.cfg = cfg
        self._embed = jax.jit(lambda p, tokens, positions: model.embed(p, cfg, tokens, positions))
        self._layer = jax.jit(
            lambda block, window, h, seg, pos: model.layer(block, cfg, window, h, seg, pos),
            static_argnums=(1,),
        )
        self._sums = jax.jit(self._loss_sums)

    def _loss_sums(self, outer, h_BxTxD, batch):
        """:func:`.model.loss_fn`'s sums from the last layer's states."""
        w_BxT = model.loss_weights(batch)
        losses_BxT = model.hidden_losses(outer, self.cfg, h_BxTxD, batch.tokens)
        return {"loss_sum": jnp.sum(losses_BxT * w_BxT), "tokens": jnp.sum(w_BxT)}

    def hidden(self, weights: Weights, outer: dict, batches: list) -> list:
        """:func:`.model.hidden` of every batch, layer by layer: a layer's weights are read
        and placed once, run over every batch, and let go before the next layer's."""
        hs = [self._embed(outer, b.tokens, b.positions) for b in batches]
        for index in range(self.cfg.n_layers):
            block = weights.layer(index)
            window = model.layer_window(self.cfg, index)
            hs = [
                self._layer(block, window, h, b.segments, b.positions)
                for h, b in zip(hs, batches, strict=True)
            ]
            del block
        return hs

    def loss_sums(self, weights: Weights, batches: list) -> list[dict]:
        """Each batch's ``{"loss_sum", "tokens"}``, as :func:`.model.loss_fn`'s aux."""
        outer = weights.outer()
        hs = self.hidden(weights, outer, batches)
        return [self._sums(outer, h, b) for h, b in zip(hs, batches, strict=True)]

    def greedy(self, weights: Weights, chunks, max_new_tokens: int, stop) -> list:
        """:func:`.model.greedy_generate_batch` of each chunk of prompts (no cache: the full
        forward over a chunk's buffer for each new token; the same buffer, choice and
        stopping rules): the new tokens, a list per chunk. The chunks advance together, so a
        layer's weights are read once per new token for all of them."""
        cfg = dataclasses.replace(
            self.cfg, execution=Execution(scan_layers=self.cfg.execution.scan_layers)
        )  # as generate_batch: the XLA attention, no remat or loss chunks
        forward = Streamed(cfg) if cfg != self.cfg else self
        stops = sampling_rules.stop_ids(stop)
        buffers = [_Buffer(chunk, max_new_tokens, cfg.max_len) for chunk in chunks]
        outer = weights.outer()
        choose = sampling_rules.choice(None, jnp.uint32(0))
        for step in range(max_new_tokens):
            live = [b for b in buffers if not b.done.all()]
            if not live:
                break
            hs = forward.hidden(weights, outer, [b.rows() for b in live])
            for buffer, h in zip(live, hs, strict=True):
                last = h[np.arange(len(buffer.lengths)), buffer.last()][:, None]
                logits = model.head(outer, cfg, last)[:, 0]
                buffer.write(np.asarray(choose(logits, jnp.int32(step))), stops)
        return [buffer.new_tokens(stops) for buffer in buffers]


class _Buffer:
    """One chunk's prompts continued in place, as :func:`.model.decode` continues them."""

    def __init__(self, prompts, max_new_tokens: int, max_len: int):
        self.prompts = [list(prompt) for prompt in prompts]
        longest = max(map(len, self.prompts), default=1)
        if longest > max_len:
            raise ValueError(f"a prompt has {longest} tokens, more than model.max_len={max_len}")
        length = model.padded_length(longest + max_new_tokens, max_len)
        self.tokens, self.lengths = model.prompt_buffer(self.prompts, length)
        self.done = self.lengths >= length

    def rows(self) -> Rows:
        B, L = self.tokens.shape
        positions = np.broadcast_to(np.arange(L, dtype=np.int32), (B, L))
        return Rows(self.tokens, np.ones((B, L), np.int32), positions)

    def last(self) -> np.ndarray:
        """Each row's last written slot, whose logits choose its next token."""
        return np.minimum(self.lengths - 1, self.tokens.shape[1] - 1)

    def write(self, new: np.ndarray, stops) -> None:
        rows, L = np.arange(len(new)), self.tokens.shape[1]
        write, slot = ~self.done, np.minimum(self.lengths, L - 1)
        self.tokens[rows, slot] = np.where(write, new, self.tokens[rows, slot])
        self.lengths = self.lengths + write
        self.done = self.done | (write & np.isin(new, stops)) | (self.lengths >= L)

    def new_tokens(self, stops) -> list[list[int]]:
        """Each prompt's continuation, its stop token dropped."""
        out = []
        for row, prompt in enumerate(self.prompts):
            tokens = self.tokens[row, len(prompt) : self.lengths[row]].tolist()
            out.append(tokens[:-1] if tokens and tokens[-1] in stops else tokens)
        return out
