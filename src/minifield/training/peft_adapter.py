"""A LoRA run's adapters as PEFT writes them (:mod:`.lora`): the ``adapter`` directory of an
export, ``adapter_config.json`` and ``adapter_model.safetensors``.

The names are those PEFT gives ``nn.Linear`` modules wrapped by ``target_modules`` (PEFT 0.13
to 0.17 with transformers 4.x, whose Mixtral, Qwen-MoE and OLMoE experts are one ``nn.Linear``
per expert): ``base_model.model.`` + the module's HF name + ``.lora_A.weight`` /
``.lora_B.weight``, the adapter name (``default``) left out as PEFT's
``get_peft_model_state_dict`` leaves it out. An expert's adapter is written once per expert
(``...block_sparse_moe.experts.{j}.w1.lora_A.weight``). ``target_modules`` lists the recipe's
names, as PEFT writes its set of them.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from .. import atomic
from . import lora

ADAPTER_DIR = "adapter"
ADAPTER_CONFIG_FILE = "adapter_config.json"
ADAPTER_WEIGHTS_FILE = "adapter_model.safetensors"


def peft_sources(cfg, adapters: dict) -> dict[str, tuple]:
    """PEFT's name -> ``(leaf, expert or None)`` of each adapter matrix, in this project's
    ``[in, rank]`` / ``[rank, out]`` layout (the stored tensor is its transpose; an expert's
    adapters are the ``expert``-th of the stacked leaf), where the leaf lives."""
    from ..models.families import expected_tensors

    modules = {
        path: hf.removesuffix(".weight")
        for hf, (path, _, _) in expected_tensors(cfg).items()
        if isinstance(path, str)
    }
    out = {}

    def put(path, pair, expert=None):
        for which in ("a", "b"):
            key = f"base_model.model.{modules[path]}.lora_{which.upper()}.weight"
            out[key] = (pair[which], expert)

    for layer, parents, leaf, pair in lora.adapted_leaves(adapters):
        if parents == lora.EXPERTS:
            for j in range(cfg.n_experts):
                put(f"blocks/{layer}/moe/experts/{j:02d}/{leaf}", pair, j)
            continue
        put("/".join(("blocks", layer, *parents, leaf)), pair)
    return out


def peft_tensors(cfg, adapters: dict) -> dict[str, np.ndarray]:
    """PEFT's names and layouts: ``base_model.model.`` + the adapted module's HF name
    (:mod:`minifield.models.families`' name table; an expert's adapter once per expert,
    ``...experts.{j}.w1`` or ``...experts.{j}.gate_proj``) + ``.lora_A.weight [rank, in]``
    (A transposed) and ``.lora_B.weight [out, rank]`` (B transposed), as
    ``torch.nn.Linear`` weights; FP32."""
    out = {}
    for key, (leaf, expert) in peft_sources(cfg, adapters).items():
        value = leaf if expert is None else leaf[expert]
        out[key] = np.ascontiguousarray(np.asarray(value, dtype=np.float32).T)
    return out


def adapter_config(settings: lora.LoraSettings, base_name: str) -> dict:
    """``adapter_config.json`` as PEFT writes it for a LoRA adapter of a causal LM."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_name,
        "revision": None,
        "r": settings.rank,
        "lora_alpha": settings.alpha,
        "lora_dropout": 0.0,
        "target_modules": list(settings.targets),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "init_lora_weights": True,
        "modules_to_save": None,
        "layers_to_transform": None,
        "inference_mode": True,
    }


def write_adapter(
    directory: Path, settings: lora.LoraSettings, adapters: dict, base_name: str, cfg, group=None
):
    """The PEFT adapter directory (``adapter_config.json``, ``adapter_model.safetensors``),
    each file written under a temporary name and renamed. ``group``: the processes of
    adapters spread over several (a collective): each writes the slices it holds
    (:mod:`minifield.hf.parallel_files`, nothing gathered), process 0 the config."""
    from safetensors.numpy import save

    directory.mkdir(parents=True, exist_ok=True)
    if group is not None:
        from ..hf import parallel_files

        tensors = {
            key: parallel_files.Tensor(
                tuple(leaf.shape[0 if expert is None else 1 :][::-1]),
                (parallel_files.Source(leaf, expert, 0, True),),
            )
            for key, (leaf, expert) in peft_sources(cfg, adapters).items()
        }
        files = {ADAPTER_WEIGHTS_FILE: tensors}
        parallel_files.write(directory, files, "float32", {"format": "pt"}, group)
        if group.rank != 0:
            return
    else:
        atomic.write_bytes(
            directory / ADAPTER_WEIGHTS_FILE, save(peft_tensors(cfg, adapters), {"format": "pt"})
        )
    text = json.dumps(adapter_config(settings, base_name), indent=2) + "\n"
    atomic.write_bytes(directory / ADAPTER_CONFIG_FILE, text.encode())
