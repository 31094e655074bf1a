"""Evaluation of a packed-sft model on a DEV or TEST split: loss over packed rows, and greedy
exact-match of the split's first prompts.

The same evaluator serves the training program (periodic and final evaluation, on the
data-parallel mesh when there is one) and, a layer at a time (:class:`StreamedEvaluator`),
the store's re-evaluation of an export. Importing this module does not import JAX (the
strategy imports it to validate recipes).
"""

from __future__ import annotations

import math

import numpy as np

from ..data import packing
from ..data.packing import Rows

#: an export whose FP32 parameters exceed this many bytes is re-evaluated by the store a layer
#: at a time (:class:`StreamedEvaluator`); a smaller one whole, as it always was: in BF16 the
#: two differ in the last bits (XLA's CPU keeps the residual stream in FP32 within one program,
#: a layer's program rounds it to BF16 between layers; docs/store-and-capacity.md)
STREAM_ABOVE_BYTES = 8 << 30


def split_arrays(split: str, encoded, recipe: dict, pad_id: int) -> tuple[dict, dict]:
    """Packed rows of a split plus its prompts/answers for generation (whole examples only),
    named ``{split}_{field}``; and the split's packing figures."""
    training = recipe["training"]
    packed = packing.pack(encoded, training["seq_len"], training["overlong"], pad_id)
    # a conversation is asked its last answer, with every earlier turn as the prompt
    whole = [e.last_turn() for e in encoded if len(e) <= training["seq_len"]]
    limit = recipe["evaluation"]["max_generate_examples"]
    arrays = packed.rows.named(split)
    generation = packing.prompts_and_answers(whole[:limit], pad_id)
    arrays.update({f"{split}_{k}": v for k, v in generation.items()})
    return arrays, {**packed.stats, "generate_examples": len(whole[:limit])}


class Evaluator:
    """DEV/TEST loss over packed rows and greedy exact-match, jit-compiled once per shape."""

    def __init__(self, cfg, batch_size: int, eos_id: int, pad_id: int):
        import jax

        from ..models import model

        self.model, self.cfg = model, cfg
        self.batch_size, self.eos_id, self.pad_id = batch_size, eos_id, pad_id
        self._loss = jax.jit(lambda p, b: model.loss_fn(p, cfg, b)[1])
        self._rows_sharding = None  # set by on_mesh: loss rows split over the data axis
        self._loss_rows = batch_size

    def on_mesh(self, rows_sharding, devices: int) -> None:
        """Evaluate the loss on the data-parallel mesh: the parameters stay in the state's
        shardings and each batch of rows is split over the devices like a training batch,
        padded up to a multiple of ``devices`` (padding rows count nothing)."""
        self._rows_sharding = rows_sharding
        self._loss_rows = -(-self.batch_size // devices) * devices

    def loss(self, params, rows: Rows) -> dict[str, float]:
        """Mean loss per trained token and perplexity, summed over every row (padding batches
        repeat row 0 with an all-zero loss mask, so they add nothing)."""
        from ..state.arrays import to_host

        total, count = 0.0, 0.0
        for out in self._sums(params, self._batches(rows)):
            # to_host: the replicated sums of a mesh spanning processes are read locally
            total += float(to_host(out["loss_sum"]))
            count += float(to_host(out["tokens"]))
        mean = total / count if count else float("nan")
        return {"loss": mean, "perplexity": math.exp(mean) if mean < 700 else float("inf")}

    def _batches(self, rows: Rows):
        """The rows in batches of the evaluated size, the last padded (see :meth:`loss`)."""
        from .data_parallel import place

        n = rows.tokens.shape[0]
        for start in range(0, n, self._loss_rows):
            index = np.arange(start, start + self._loss_rows)
            valid = index < n
            batch = rows.take(np.where(valid, index, 0))
            batch = batch._replace(loss_mask=batch.loss_mask * valid[:, None].astype(np.float32))
            if self._rows_sharding is not None:
                batch = Rows(*(place(v, self._rows_sharding) for v in batch))
            yield batch

    def _sums(self, params, batches):
        """Each batch's ``{"loss_sum", "tokens"}``, in order."""
        return (self._loss(params, batch) for batch in batches)

    def _generate(self, params, chunks, max_new: int) -> list[list[list[int]]]:
        """Each chunk's greedy continuations, chunk after chunk."""
        return [
            self.model.greedy_generate_batch(params, self.cfg, chunk, max_new, self.eos_id)
            for chunk in chunks
        ]

    def exact_match(self, params, prompts, prompt_len, answers, answer_len) -> dict[str, float]:
        """Share of prompts whose greedy continuation is the answer followed by ``<eos>``.

        ``answers`` end with ``<eos>``; generation may produce as many tokens as
        the longest answer holds (``<eos>`` included), so a continuation that
        does not stop right after the answer has an extra token and never matches.
        Prompts go in fixed-size chunks (the last padded with repeats) so one
        compilation serves every chunk.
        """
        n = int(prompts.shape[0])
        if n == 0:
            # Nothing generated: no figure (null in JSON) rather than a NaN events cannot hold.
            return {"exact_match": None, "generated": 0}
        max_new = int(np.max(answer_len))
        starts = range(0, n, self.batch_size)
        chunks = [
            [
                np.asarray(prompts[i, : prompt_len[i]]).tolist()
                for i in (min(i, n - 1) for i in range(start, start + self.batch_size))
            ]
            for start in starts
        ]
        correct = 0
        for start, outputs in zip(starts, self._generate(params, chunks, max_new), strict=True):
            for i, new in zip(range(start, min(start + self.batch_size, n)), outputs, strict=False):
                expected = np.asarray(answers[i, : answer_len[i] - 1]).tolist()
                correct += new == expected
        return {"exact_match": correct / n, "generated": n}

    def split_metrics(self, params, arrays: dict[str, np.ndarray], split: str) -> dict[str, float]:
        loss = self.loss(params, Rows.of(arrays, split))
        match = self.exact_match(
            params,
            arrays[f"{split}_prompts"],
            arrays[f"{split}_prompt_len"],
            arrays[f"{split}_answers"],
            arrays[f"{split}_answer_len"],
        )
        return {
            f"{split}_loss": loss["loss"],
            f"{split}_perplexity": loss["perplexity"],
            f"{split}_exact_match": match["exact_match"],
            f"{split}_generated": match["generated"],
        }


class StreamedEvaluator(Evaluator):
    """:class:`Evaluator` of a model given a layer at a time (``params``: a
    :class:`minifield.models.streamed.Weights`): the same batches, sums and exact-match
    rule, each layer's weights held only while it runs over every batch (the store's
    re-evaluation of an export, in memory bounded by a layer: docs/store-and-capacity.md)."""

    def __init__(self, cfg, batch_size: int, eos_id: int, pad_id: int):
        from ..models import streamed

        super().__init__(cfg, batch_size, eos_id, pad_id)
        self._streamed = streamed.Streamed(cfg)

    def _sums(self, params, batches):
        return self._streamed.loss_sums(params, list(batches))

    def _generate(self, params, chunks, max_new: int) -> list[list[list[int]]]:
        """Every chunk at once: each layer read once per new token for all of them."""
        return self._streamed.greedy(params, chunks, max_new, self.eos_id)
