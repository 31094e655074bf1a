"""LoRA fine-tuning of a pinned base model (``model.lora``), and its PEFT-format adapter.

A recipe with ``model.base`` and ``model.lora: {rank, alpha, targets, base_dtype}`` trains
low-rank adapters instead of the model: each target projection ``W [in, out]`` (as
:mod:`minifield.models.llama` sees it) computes ``x @ W + (alpha / rank) * (x @ A) @ B`` with ``A [in, rank]``
and ``B [rank, out]``. The base is frozen: on the device as its checkpoint stores it (dtype and
HF's ``[out, in]`` layout, :mod:`minifield.hf.stored_base`) and seen by the model in ``base_dtype``, the
conversion made inside the jitted step; the adapters, their gradients and their optimizer
state are FP32; nothing else is trained.

Initialisation (as PEFT's default ``init_lora_weights=True``): ``A`` uniform in
``[-1/sqrt(in), 1/sqrt(in)]`` (PEFT's ``kaiming_uniform_(a=sqrt(5))`` bound), drawn from
``fold_in(fold_in(fold_in(key(seed), 0), layer), target index)`` with the target index the
position in :data:`TARGETS`, so the draw does not depend on the order the recipe lists
targets; ``B`` zeros, so the first forward is the base model's.

The complete training state is::

    {"params": adapters, "opt_state": AdamW state of the adapters only, "rng", "step",
     "cursor", "frozen_base": uint8[32]}

``frozen_base`` is :func:`base_identity`: sha256 of the base model's pinned input names and
hashes plus ``base_dtype``. The frozen base itself is not in checkpoints: a resumed attempt
re-reads it from the prepared examples (made from those pinned inputs, addressed by their
digest), so the state hash (of every state array, ``frozen_base`` included) identifies the
complete training state: adapters, optimizer, counters and which base they adapt.

Evaluation and export use the merged weights ``W + (alpha / rank) * A @ B`` (FP32, from the
base as held); the export adds the PEFT adapter directory (:func:`write_adapter`).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .. import atomic
from ..digest import sha256_json

#: PEFT target module name -> (the HF module path inside a layer, the internal parameter)
TARGETS = {
    "q_proj": ("self_attn.q_proj", "attn/wq"),
    "k_proj": ("self_attn.k_proj", "attn/wk"),
    "v_proj": ("self_attn.v_proj", "attn/wv"),
    "o_proj": ("self_attn.o_proj", "attn/wo"),
    "gate_proj": ("mlp.gate_proj", "mlp/w_gate"),
    "up_proj": ("mlp.up_proj", "mlp/w_up"),
    "down_proj": ("mlp.down_proj", "mlp/w_down"),
}
#: the state part that identifies the frozen base (see the module docstring)
BASE_PART = "frozen_base"
ADAPTER_DIR = "adapter"
ADAPTER_CONFIG_FILE = "adapter_config.json"
ADAPTER_WEIGHTS_FILE = "adapter_model.safetensors"
#: the PEFT key of an adapter matrix ({i}: layer index, {module}: TARGETS' HF module path)
PEFT_KEY = "base_model.model.model.layers.{i}.{module}.lora_{which}.weight"


@dataclass(frozen=True)
class LoraSettings:
    rank: int
    alpha: float
    targets: tuple[str, ...]
    base_dtype: str = "float32"

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    @classmethod
    def from_recipe(cls, model: dict) -> LoraSettings | None:
        section = model.get("lora")
        if section is None:
            return None
        return cls(
            section["rank"],
            float(section["alpha"]),
            tuple(section["targets"]),
            section["base_dtype"],
        )

    def to_dict(self) -> dict:
        return {
            "rank": self.rank,
            "alpha": self.alpha,
            "targets": list(self.targets),
            "base_dtype": self.base_dtype,
        }


def normalize_section(recipe: dict) -> list[dict]:
    """Check ``model.lora`` and give it one spelling (targets in :data:`TARGETS` order, alpha a
    float), so the same adapters are the same computation digest; returns errors."""
    model = recipe["model"]
    section = model.get("lora")
    if section is None:
        return []
    errors = []
    if "base" not in model:
        errors.append(
            {
                "path": "/model/lora",
                "message": "LoRA adapts a pinned base model: it needs model.base",
            }
        )
    if model.get("architecture") != "llama":  # gpt (the default) has been removed by now
        errors.append({"path": "/model/lora", "message": "LoRA needs model.architecture llama"})
    if recipe["training"]["data_parallel"]["devices"] != 1:
        errors.append(
            {
                "path": "/model/lora",
                "message": "LoRA runs on one device (training.data_parallel.devices must be 1)",
            }
        )
    section["targets"] = [t for t in TARGETS if t in section["targets"]]
    section["alpha"] = float(section["alpha"])
    return errors


def base_identity(recipe: dict, input_names: list[str]) -> np.ndarray:
    """``frozen_base``: sha256 of the base model's pinned inputs (name -> sha256) and the
    dtype it is held in, as 32 bytes."""
    pinned = {i["name"]: i["sha256"] for i in recipe.get("inputs", [])}
    digest = sha256_json(
        {
            "base_inputs": {name: pinned[name] for name in sorted(input_names)},
            "base_dtype": recipe["model"]["lora"]["base_dtype"],
        }
    )
    return np.frombuffer(bytes.fromhex(digest), dtype=np.uint8).copy()


# ----------------------------------------------------------------------------- parameters


def _target_shape(cfg, internal: str) -> tuple[int, int]:
    from ..models.families import param_shape

    return param_shape(cfg, f"blocks/00/{internal}")


def init_adapters(cfg, settings: LoraSettings, key) -> dict:
    """FP32 adapters ``{"blocks": {NN: {"attn"|"mlp": {leaf: {"a", "b"}}}}}`` (docstring)."""
    import jax
    import jax.numpy as jnp

    blocks: dict = {}
    for i in range(cfg.n_layers):
        layer_key = jax.random.fold_in(key, i)
        block: dict = {}
        for index, name in enumerate(TARGETS):
            if name not in settings.targets:
                continue
            group, leaf = TARGETS[name][1].split("/")
            fan_in, fan_out = _target_shape(cfg, TARGETS[name][1])
            bound = 1.0 / math.sqrt(fan_in)
            a = jax.random.uniform(
                jax.random.fold_in(layer_key, index),
                (fan_in, settings.rank),
                jnp.float32,
                minval=-bound,
                maxval=bound,
            )
            b = jnp.zeros((settings.rank, fan_out), jnp.float32)
            block.setdefault(group, {})[leaf] = {"a": a, "b": b}
        blocks[f"{i:02d}"] = block
    return {"blocks": blocks}


def init_state(cfg, settings: LoraSettings, optimizer, seed: int, identity: np.ndarray) -> dict:
    """The step-0 state (the module docstring's layout)."""
    import jax
    import jax.numpy as jnp

    key = jax.random.key(seed)
    adapters = init_adapters(cfg, settings, jax.random.fold_in(key, 0))
    return {
        "params": adapters,
        "opt_state": optimizer.init(adapters),
        "rng": jax.random.key_data(key),
        "step": jnp.zeros((), jnp.int32),
        "cursor": jnp.zeros((), jnp.int32),
        BASE_PART: jnp.asarray(identity, jnp.uint8),
    }


def _model_params(base) -> dict:
    """The base as :mod:`minifield.models.llama` runs it: a :class:`minifield.hf.stored_base.FrozenBase` (as stored) made
    into parameters inside the traced function, or a parameter tree as it is."""
    from ..hf.stored_base import FrozenBase

    return base.model_params() if isinstance(base, FrozenBase) else base


def _adapted_leaves(adapters: dict):
    for layer, block in adapters["blocks"].items():
        for group, leaves in block.items():
            for leaf, pair in leaves.items():
                yield layer, group, leaf, pair


def adapted(base: dict, adapters: dict, settings: LoraSettings) -> dict:
    """The parameter tree :mod:`minifield.models.llama` runs: the base's, with every target matrix replaced
    by a :class:`minifield.models.llama.LoraWeight` (base matrix, A, B, scale)."""
    from ..models.llama import LoraWeight

    base = _model_params(base)
    params = {**base, "blocks": {k: dict(v) for k, v in base["blocks"].items()}}
    for layer, group, leaf, pair in _adapted_leaves(adapters):
        block = params["blocks"][layer]
        block[group] = {**block[group]}
        block[group][leaf] = LoraWeight(block[group][leaf], pair["a"], pair["b"], settings.scale)
    return params


def merged(base: dict, adapters: dict, settings: LoraSettings) -> dict:
    """FP32 parameters with the adapters merged: ``W + (alpha / rank) * A @ B`` per target
    (FP32 products); every other parameter is the base's, as FP32."""
    import jax
    import jax.numpy as jnp

    params = jax.tree_util.tree_map(lambda a: a.astype(jnp.float32), _model_params(base))
    params["blocks"] = {k: dict(v) for k, v in params["blocks"].items()}
    for layer, group, leaf, pair in _adapted_leaves(adapters):
        block = params["blocks"][layer]
        block[group] = {**block[group]}
        delta = jnp.matmul(pair["a"], pair["b"], precision=jax.lax.Precision.HIGHEST)
        block[group][leaf] = block[group][leaf] + settings.scale * delta
    return params


def make_train_step(
    cfg,
    settings: LoraSettings,
    optimizer,
    schedule=None,
    accum_steps=1,
    objective=None,
    accumulation=None,
):
    """``train_step(state, base, batch) -> (state, metrics)``: :mod:`.train_step`'s update with
    the loss differentiated with respect to the adapters only (``base`` is an argument, not
    donated, never updated); ``frozen_base`` is carried unchanged. ``objective(params, cfg,
    batch)``: the loss of the adapted parameters (None: the supervised ``model.loss_fn``);
    ``accumulation``: what it is a mean over (None: trained tokens,
    :class:`.train_step.Accumulation`)."""
    from ..models import model
    from . import train_step as full_step

    objective = objective or model.loss_fn

    def train_step(state: dict, base: dict, batch: dict):
        def loss(adapters, cfg, batch):
            return objective(adapted(base, adapters, settings), cfg, batch)

        inner = full_step.make_train_step(
            cfg, optimizer, schedule, loss, accum_steps, accumulation or full_step.TOKEN_MEAN
        )
        core = {k: v for k, v in state.items() if k != BASE_PART}
        new_state, metrics = inner(core, batch)
        return {**new_state, BASE_PART: state[BASE_PART]}, metrics

    return train_step


# ----------------------------------------------------------------------------- PEFT adapter


def peft_tensors(adapters: dict) -> dict[str, np.ndarray]:
    """PEFT's names and layouts: ``lora_A.weight [rank, in]`` (A transposed) and
    ``lora_B.weight [out, rank]`` (B transposed), as ``torch.nn.Linear`` weights; FP32."""
    modules = {internal: module for module, internal in TARGETS.values()}
    out = {}
    for layer, group, leaf, pair in _adapted_leaves(adapters):
        module = modules[f"{group}/{leaf}"]
        for which, value in (("A", pair["a"]), ("B", pair["b"])):
            key = PEFT_KEY.format(i=int(layer), module=module, which=which)
            out[key] = np.ascontiguousarray(np.asarray(value, dtype=np.float32).T)
    return out


def adapter_config(settings: LoraSettings, base_name: str) -> dict:
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


def write_adapter(directory: Path, settings: LoraSettings, adapters: dict, base_name: str):
    """The PEFT adapter directory (``adapter_config.json``, ``adapter_model.safetensors``),
    each file written under a temporary name and renamed."""
    from safetensors.numpy import save

    directory.mkdir(parents=True, exist_ok=True)
    atomic.write_bytes(
        directory / ADAPTER_WEIGHTS_FILE, save(peft_tensors(adapters), {"format": "pt"})
    )
    text = json.dumps(adapter_config(settings, base_name), indent=2) + "\n"
    atomic.write_bytes(directory / ADAPTER_CONFIG_FILE, text.encode())
