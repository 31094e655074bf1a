"""The one adapter between the harness and minifield's model code: loading an export, its
forward and its greedy generation.

Everything the harness model needs from an export goes through here, so switching to a public
loading API (``minifield.load_model``) changes this module only.

The compute dtype is the export's declared one by default (``dtype="auto"``, as lm-eval's
``hf`` model loads a directory): ``config.json``'s ``dtype`` or ``torch_dtype``, not the
precision the run trained in (a BF16-compute run exports FP32 weights and declares
``float32``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: the ``dtype`` model argument's values: the declared dtype, or one minifield computes in
DTYPES = ("auto", "float32", "bfloat16")
#: what a declared dtype is computed in: minifield has no FP16 forward, so float16 weights
#: (exact in FP32) are scored in FP32
COMPUTE_OF_DECLARED = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float32"}


@dataclass(frozen=True)
class Loaded:
    """An export ready to score and generate: parameters, model config (computing in
    ``dtype``), tokenizer and (for a base-model run) its chat template."""

    directory: Path
    params: Any
    cfg: Any
    tokenizer: Any
    template: Any  # chat_template.ChatTemplate or None
    #: the compute dtype scoring and generation use (``cfg.compute_dtype``)
    dtype: str = "float32"


class LoadError(ValueError):
    """An export that cannot be loaded (names the directory and what is wrong)."""


def load(path: str | Path, dtype: str = "auto") -> Loaded:
    """The export at ``path``, computing in ``dtype``: ``auto`` (the export's declared dtype,
    :func:`declared_dtype`), ``float32`` or ``bfloat16``."""
    import dataclasses

    from ..data import tokenizer as tokenizers
    from ..state import export
    from ..strategies.lm.export_format import ExportedModel

    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r}: expected one of {', '.join(DTYPES)}")
    try:
        exported = ExportedModel(Path(path))
        if dtype == "auto":
            dtype = COMPUTE_OF_DECLARED[declared_dtype(Path(path), exported.config)]
    except (export.ExportError, tokenizers.TokenizerError, OSError) as exc:
        raise LoadError(f"model path {path}: {exc}") from None
    cfg = dataclasses.replace(exported.cfg, compute_dtype=dtype)
    return Loaded(Path(path), exported.params, cfg, exported.tokenizer, exported.template, dtype)


def declared_dtype(directory: Path, model_json: dict) -> str:
    """The dtype an export declares its weights in, as transformers' ``dtype="auto"`` reads
    it: ``config.json``'s ``dtype`` (transformers >= 4.56) or ``torch_dtype``; without one,
    the stored tensors' (``model.json``'s ``weights.dtype``; the GPT model's own format is
    FP32). Raises ``ExportError`` for a dtype an export cannot hold."""
    from ..state import export

    config_path = directory / "config.json"
    declared, where = None, config_path
    if config_path.is_file():
        try:
            config = json.loads(config_path.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, ValueError) as exc:
            raise export.ExportError(f"{config_path}: not readable JSON ({exc})") from None
        if isinstance(config, dict):
            declared = config.get("dtype", config.get("torch_dtype"))
    if declared is None:
        declared = (model_json.get("weights") or {}).get("dtype", "float32")
        where = directory / export.MODEL_FILE
    if declared not in COMPUTE_OF_DECLARED:
        raise export.ExportError(
            f"{where}: declares dtype {declared!r}, expected one of "
            f"{', '.join(COMPUTE_OF_DECLARED)}"
        )
    return declared


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
    one batch, in ``loaded.dtype``; a Llama model uses its key/value cache when ``cache``."""
    from ..models import model

    return model.greedy_generate_batch(
        loaded.params, loaded.cfg, prompts, max_new, loaded.tokenizer.eos_id, cache
    )
