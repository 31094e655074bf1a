"""Sharded safetensors checkpoints as Hugging Face writes them: the plan, the names, the index.

A checkpoint bigger than ``max_shard_size`` is split over ``model-00001-of-0000N.safetensors``
files plus ``model.safetensors.index.json``, exactly as ``PreTrainedModel.save_pretrained``
splits it (through ``huggingface_hub.split_torch_state_dict_into_shards``):

- the tensors are taken in the state dict's order and each goes into the current shard
  unless that would make the shard's bytes exceed ``max_shard_size`` (``>``: a shard may be
  exactly the limit), which closes the shard; a tensor bigger than the limit alone gets a
  shard of its own, placed where it comes, the current shard staying open; no reordering to
  fill shards better;
- ``max_shard_size``: bytes, or a string ``"<number><unit>"`` with the unit TB, GB, MB or KB in
  powers of ten (``"5GB"`` = 5·10⁹, huggingface_hub's default and the recipe's; ``"1.5KB"`` =
  1500), parsed as ``huggingface_hub.serialization.parse_size_to_int`` does;
- one shard is ``model.safetensors`` and no index; N shards are
  ``model-{i:05d}-of-{N:05d}.safetensors`` (i from 1) and the index
  ``{"metadata": {"total_parameters", "total_size"}, "weight_map": {tensor: file}}``, written
  as transformers writes it (``json.dumps(indent=2, sort_keys=True)`` and a newline);
  ``total_size`` is the tensors' bytes, ``total_parameters`` their elements.

This module plans from names and sizes alone (no tensor is needed), so the writer converts
and holds one shard's tensors at a time (:func:`minifield.hf.checkpoint.write`).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

SIZE_UNITS = {"TB": 10**12, "GB": 10**9, "MB": 10**6, "KB": 10**3}
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_NUMBER = re.compile(r"\s*[0-9]*\.?[0-9]+\s*")

#: a decoder layer's tensors in the order HF's PyTorch classes register them (their
#: ``state_dict()`` order, which ``save_pretrained`` shards in): attention (each Linear's weight
#: then bias; Phi-3 registers ``o_proj`` before ``qkv_proj``; Qwen3/OLMoE's norms after
#: ``o_proj``), the MLP or mixture (router, then each expert's matrices, then the shared
#: expert), then the norms; ``{j}``: an expert's index
_LAYER_ORDER = [
    f"self_attn.{n}"
    for n in (
        "q_proj.weight", "q_proj.bias", "k_proj.weight", "k_proj.bias", "v_proj.weight",
        "v_proj.bias", "o_proj.weight", "qkv_proj.weight", "q_norm.weight", "k_norm.weight",
    )
] + [
    f"mlp.{n}.weight"
    for n in (
        "gate_proj", "up_proj", "gate_up_proj", "down_proj", "gate", "experts.{j}.gate_proj",
        "experts.{j}.up_proj", "experts.{j}.down_proj", "shared_expert.gate_proj",
        "shared_expert.up_proj", "shared_expert.down_proj", "shared_expert_gate",
    )
] + [
    "block_sparse_moe.gate.weight", "block_sparse_moe.experts.{j}.w1.weight",
    "block_sparse_moe.experts.{j}.w2.weight", "block_sparse_moe.experts.{j}.w3.weight",
    "input_layernorm.weight", "post_attention_layernorm.weight",
    "pre_feedforward_layernorm.weight", "post_feedforward_layernorm.weight",
]  # fmt: skip
_LAYER = re.compile(r"model\.layers\.(\d+)\.(.*)")
_EXPERT = re.compile(r"(.*\.experts)\.(\d+)\.(.*)")


def parse_size(value) -> int:
    """``max_shard_size`` in bytes: a positive int as it is, a string as huggingface_hub's
    ``parse_size_to_int`` reads it (surrounding spaces dropped, the last two characters the
    unit, any case; the rest a decimal number; ``int(number * unit)``). Raises ValueError
    saying what is accepted."""
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ValueError(f"{value!r}: expected a number of bytes or a string like '5GB'")
    if isinstance(value, str):
        text = value.strip()
        unit = text[-2:].upper()
        # the number as huggingface_hub's float() accepts it, less its inf/nan/exponent forms
        if unit not in SIZE_UNITS or not _NUMBER.fullmatch(text[:-2]):
            raise ValueError(
                f"{value!r}: expected a number of bytes or a number followed by TB, GB, MB or "
                "KB (powers of ten), like '5GB' or '500MB'"
            )
        value = int(float(text[:-2]) * SIZE_UNITS[unit])
    if value < 1:
        raise ValueError(f"{value!r}: a shard holds at least one byte")
    return value


def _order_key(name: str) -> tuple:
    layer = _LAYER.fullmatch(name)
    if layer is None:  # embeddings first, then the final norm and the head
        top = ["model.embed_tokens.weight", None, "model.norm.weight", "lm_head.weight"]
        return (top.index(name),) if name in top else (len(top), name)
    rest, expert = layer.group(2), -1
    found = _EXPERT.fullmatch(rest)
    if found is not None:  # each expert's matrices together, the experts in index order
        expert = int(found.group(2))
        rest = f"{found.group(1)}.{{j}}.{found.group(3)}"
        group = f"{found.group(1)}.{{j}}."
        first = next((p for p in _LAYER_ORDER if p.startswith(group)), None)
        return (1, int(layer.group(1)), _rank(first), expert, _rank(rest))
    return (1, int(layer.group(1)), _rank(rest), expert, 0)


def _rank(rest: str | None) -> int:
    return _LAYER_ORDER.index(rest) if rest in _LAYER_ORDER else len(_LAYER_ORDER)


def torch_order(names) -> list[str]:
    """``names`` (HF tensor names) in the order the PyTorch model's ``state_dict()`` gives them:
    the embeddings, each layer in turn (:data:`_LAYER_ORDER`), the final norm, the head; a
    name this table does not know goes after the known ones of its layer."""
    return sorted(names, key=_order_key)


@dataclass(frozen=True)
class Plan:
    """File name -> the tensor names it holds (in order), and the index (None: one file)."""

    files: dict[str, list[str]]
    index: dict | None


def plan(sizes: dict[str, int], max_shard_size: int | None, elements: dict[str, int]) -> Plan:
    """The shards of tensors of ``sizes`` (name -> bytes, in state-dict order) under
    ``max_shard_size`` bytes (None: one file whatever the size); ``elements``: name -> element
    count, for the index's ``total_parameters``."""
    if max_shard_size is None:
        return Plan({SINGLE_FILE: list(sizes)}, None)
    shards: list[list[str]] = []
    current: list[str] = []
    current_size = 0
    for name, size in sizes.items():
        if size > max_shard_size:  # alone, where it comes; the current shard stays open
            shards.append([name])
            continue
        if current_size + size > max_shard_size:
            shards.append(current)
            current, current_size = [], 0
        current.append(name)
        current_size += size
    if current:
        shards.append(current)
    if len(shards) <= 1:
        return Plan({SINGLE_FILE: list(sizes)}, None)
    count = len(shards)
    files = {
        f"model-{i + 1:05d}-of-{count:05d}.safetensors": names for i, names in enumerate(shards)
    }
    weight_map = {name: file for file, names in files.items() for name in names}
    metadata = {"total_parameters": sum(elements.values()), "total_size": sum(sizes.values())}
    return Plan(files, {"metadata": metadata, "weight_map": weight_map})


def index_bytes(index: dict) -> bytes:
    """The index file's bytes, as transformers writes them."""
    return (json.dumps(index, indent=2, sort_keys=True) + "\n").encode()
