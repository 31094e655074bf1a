"""The one adapter between the harness and minifield's model code: loading an export, its
forward and its greedy generation.

Everything the harness model needs from an export goes through here, so switching to a public
loading API (``minifield.load_model``) changes this module only.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Loaded:
    """An export ready to score and generate: parameters, model config, tokenizer and (for a
    base-model run) its chat template."""

    directory: Path
    params: Any
    cfg: Any
    tokenizer: Any
    template: Any  # chat_template.ChatTemplate or None


class LoadError(ValueError):
    """An export that cannot be loaded (names the directory and what is wrong)."""


def load(path: str | Path) -> Loaded:
    from ..data import tokenizer as tokenizers
    from ..state import export
    from ..strategies.lm.export_format import ExportedModel

    try:
        exported = ExportedModel(Path(path))
    except (export.ExportError, tokenizers.TokenizerError, OSError) as exc:
        raise LoadError(f"model path {path}: {exc}") from None
    return Loaded(Path(path), exported.params, exported.cfg, exported.tokenizer, exported.template)


def scoring_config(cfg):
    """``cfg`` for scoring and generation: the XLA attention (buffers of any length), no remat
    or loss chunks; a scanned stack stays scanned (as generation does)."""
    import dataclasses

    from ..models.execution import Execution

    return dataclasses.replace(cfg, execution=Execution(scan_layers=cfg.execution.scan_layers))


def forward(params, cfg, tokens_BxT):
    """FP32 logits ``[B, T, V]`` of unpacked rows (one segment per row, positions from 0)."""
    import jax.numpy as jnp

    from ..models import model

    B, T = tokens_BxT.shape
    positions_BxT = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    return model.forward(params, cfg, tokens_BxT, jnp.ones((B, T), jnp.int32), positions_BxT)


def generate(loaded: Loaded, prompts: list[list[int]], max_new: int, cache: bool):
    """Greedy continuations (new tokens, the end-of-sequence token excluded) of ``prompts`` in
    one batch; a Llama model uses its key/value cache when ``cache``."""
    from ..models import model

    return model.greedy_generate_batch(
        loaded.params, loaded.cfg, prompts, max_new, loaded.tokenizer.eos_id, cache
    )
