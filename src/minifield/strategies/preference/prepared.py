"""A preference recipe's pinned files as prepared arrays: the base model and each split's
packed pairs (:mod:`.pairs`), which both the strategy's prepare and the reference product
(:mod:`.reference`) start from.

Arrays: the base model's (:func:`minifield.hf.pinned_base.load`), ``{split}_{field}`` for each
split and field of :data:`.pairs.PAIR_FIELDS`, and ``{split}_pairs`` (the split's pair count,
packed or not: the reference's per-pair arrays have that length).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ...data.formats import DataError
from ...hf import pinned_base
from . import pairs
from .section import SPLITS

#: part of the examples and reference digests: bumped when the same files prepare otherwise
PREPARE_VERSION = 1


def prepare_pairs(recipe: dict, files: dict[str, Path]) -> tuple[dict[str, np.ndarray], dict]:
    """The base model's arrays and every split's packed pairs, with their statistics."""
    training = recipe["training"]
    arrays, meta = pinned_base.load(recipe, files, without_router_loss="preference")
    tokenizer, template = pinned_base.tokenizer_from_arrays(recipe, arrays, files)
    meta = {"base_model": meta, "chat_template": template.source, "splits": {}}
    for split in SPLITS:
        encoded = pairs.encode(pairs.read(files[split]), tokenizer, template)
        packed = pairs.pack(encoded, training["seq_len"], training["overlong"], tokenizer.pad_id)
        if packed.stats["rows"] == 0:
            raise DataError(
                f"{files[split]}: no pair fits training.seq_len={training['seq_len']} "
                "(both answers after the prompt, in one row)"
            )
        arrays.update(packed.rows.named(split))
        arrays[f"{split}_pairs"] = np.asarray(len(encoded), np.int64)
        meta["splits"][split] = packed.stats
    return arrays, meta


def model_of(recipe: dict, arrays: dict[str, np.ndarray]):
    """``(config, FP32 base parameters, tokenizer)`` of prepared arrays."""
    from ...models import execution

    tokenizer, _ = pinned_base.tokenizer_from_arrays(recipe, arrays)
    cfg = execution.with_recipe_options(pinned_base.config_from_arrays(recipe, arrays), recipe)
    return cfg, pinned_base.params_from_arrays(arrays), tokenizer
