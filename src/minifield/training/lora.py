"""LoRA fine-tuning of a pinned base model (``model.lora``); its PEFT-format adapter is
:mod:`.peft_adapter`.

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
targets; ``B`` zeros, so the first forward is the base model's. A mixture's experts
(:func:`target_paths`): expert ``j``'s ``A`` from ``fold_in(that key, j)``, Qwen2-MoE's
shared expert's from ``fold_in(that key, E)``, held stacked ``A [E, in, rank]``,
``B [E, rank, out]`` and applied in the experts' own groups (:mod:`minifield.models.moe`).

The complete training state is::

    {"params": adapters, "opt_state": AdamW state of the adapters only, "rng", "step",
     "cursor", "frozen_base": uint8[32]}

``frozen_base`` is :func:`base_identity`: sha256 of the base model's pinned input names and
hashes plus ``base_dtype``. The frozen base itself is not in checkpoints: a resumed attempt
re-reads it from the prepared examples (made from those pinned inputs, addressed by their
digest), so the state hash (of every state array, ``frozen_base`` included) identifies the
complete training state: adapters, optimizer, counters and which base they adapt.

Evaluation and export use the merged weights ``W + (alpha / rank) * A @ B`` (FP32, from the
base as held; the export's made on the host tensor by tensor, :mod:`.host_merge`); a quantized
base is evaluated as the step runs it instead (:func:`adapted`: its codes, the adapters
beside them). The export adds the PEFT adapter directory
(:func:`minifield.training.peft_adapter.write_adapter`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..digest import sha256_json
from ..models.lora_targets import EXPERTS, TARGETS, target_paths

#: the state part that identifies the frozen base (see the module docstring)
BASE_PART = "frozen_base"


@dataclass(frozen=True)
class LoraSettings:
    rank: int
    alpha: float
    targets: tuple[str, ...]
    base_dtype: str = "float32"
    #: ``model.lora.base_quantization`` (None: the base held unquantized), its block size
    #: (None: per output channel for int8, 64 for NF4) and double quantization of the scales
    quantization: str | None = None
    block: int | None = None
    double: bool = False

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    @classmethod
    def from_recipe(cls, model: dict) -> LoraSettings | None:
        section = model.get("lora")
        if section is None:
            return None
        scheme = section.get("base_quantization", "none")
        return cls(
            section["rank"],
            float(section["alpha"]),
            tuple(section["targets"]),
            section["base_dtype"],
            None if scheme == "none" else scheme,
            section.get("quantization_block"),
            section.get("double_quantization", False),
        )

    def to_dict(self) -> dict:
        out = {
            "rank": self.rank,
            "alpha": self.alpha,
            "targets": list(self.targets),
            "base_dtype": self.base_dtype,
        }
        return {**out, **quantization_dict(self)} if self.quantization else out


def quantization_dict(settings: LoraSettings) -> dict:
    """The quantization settings as the frozen base's identity and the export record them."""
    return {
        "base_quantization": settings.quantization,
        "quantization_block": settings.block,
        "double_quantization": settings.double,
    }


def normalize_section(recipe: dict, data_parallel: bool = False) -> list[dict]:
    """Check ``model.lora`` and give it one spelling (targets in :data:`TARGETS` order, alpha a
    float), so the same adapters are the same computation digest; returns errors.
    ``data_parallel``: whether the strategy runs LoRA on several devices (packed-sft's
    program does; the others refuse ``devices`` > 1)."""
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
    if not data_parallel and recipe["training"]["data_parallel"]["devices"] != 1:
        errors.append(
            {
                "path": "/model/lora",
                "message": "LoRA runs on one device (training.data_parallel.devices must be 1)",
            }
        )
    section["targets"] = [t for t in TARGETS if t in section["targets"]]
    section["alpha"] = float(section["alpha"])
    return errors + _quantization_errors(recipe, section)


def _quantization_errors(recipe: dict, section: dict) -> list[dict]:
    """``base_quantization``'s companions need it; a quantized base runs on one device."""
    scheme = section.get("base_quantization", "none")
    errors = []
    if scheme == "none":
        for key in ("quantization_block", "double_quantization"):
            if key in section:
                message = f"{key} applies to a quantized base: set model.lora.base_quantization"
                errors.append({"path": f"/model/lora/{key}", "message": message})
        section.pop("base_quantization", None)  # none spelled out is absent: the same digest
        return errors
    if not section.get("double_quantization", True):
        section.pop("double_quantization")
    if section.get("quantization_block", 2) % 2 and scheme == "nf4":
        message = "NF4 packs two codes per byte: the block size must be even"
        errors.append({"path": "/model/lora/quantization_block", "message": message})
    if recipe["training"]["data_parallel"]["devices"] != 1:
        message = "a quantized base runs on one device (training.data_parallel.devices must be 1)"
        errors.append({"path": "/model/lora/base_quantization", "message": message})
    return errors


def base_identity(recipe: dict, input_names: list[str]) -> np.ndarray:
    """``frozen_base``: sha256 of the base model's pinned inputs (name -> sha256) and the
    dtype it is held in, as 32 bytes."""
    pinned = {i["name"]: i["sha256"] for i in recipe.get("inputs", [])}
    identity = {
        "base_inputs": {name: pinned[name] for name in sorted(input_names)},
        "base_dtype": recipe["model"]["lora"]["base_dtype"],
    }
    settings = LoraSettings.from_recipe(recipe["model"])
    if settings.quantization:  # the quantized base follows from the pinned one and these
        identity["quantization"] = quantization_dict(settings)
    digest = sha256_json(identity)
    return np.frombuffer(bytes.fromhex(digest), dtype=np.uint8).copy()


# ----------------------------------------------------------------------------- parameters


def init_adapters(cfg, settings: LoraSettings, key) -> dict:
    """FP32 adapters ``{"blocks": {NN: {"attn"|"mlp"|"moe": {... leaf: {"a", "b"}}}}}``
    (docstring); the experts' stacked, ``a [E, in, r]``, ``b [E, r, out]``."""
    import jax
    import jax.numpy as jnp

    from ..models.families import param_shape

    def draw(k, fan_in, fan_out):
        bound = 1.0 / math.sqrt(fan_in)
        shape = (fan_in, settings.rank)
        a = jax.random.uniform(k, shape, jnp.float32, minval=-bound, maxval=bound)
        return a, jnp.zeros((settings.rank, fan_out), jnp.float32)

    blocks: dict = {}
    for i in range(cfg.n_layers):
        layer_key = jax.random.fold_in(key, i)
        block: dict = {}
        for index, name in enumerate(TARGETS):
            if name not in settings.targets:
                continue
            target_key = jax.random.fold_in(layer_key, index)
            for path in target_paths(cfg, i, name):
                fan_in, fan_out = param_shape(cfg, f"blocks/{i:02d}/{path}")[-2:]  # experts: each
                if path.startswith("moe/experts/"):  # expert j: fold_in(target key, j)
                    E = cfg.n_experts
                    keys = [jax.random.fold_in(target_key, j) for j in range(E)]
                    a = jnp.stack([draw(k, fan_in, fan_out)[0] for k in keys])
                    b = jnp.zeros((E, settings.rank, fan_out), jnp.float32)
                elif path.startswith("moe/shared/"):  # the shared expert: as expert E
                    a, b = draw(jax.random.fold_in(target_key, cfg.n_experts), fan_in, fan_out)
                else:
                    a, b = draw(target_key, fan_in, fan_out)
                *parents, leaf = path.split("/")
                node = block
                for part in parents:
                    node = node.setdefault(part, {})
                node[leaf] = {"a": a, "b": b}
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


def _pairs(node: dict, prefix: str = ""):
    if set(node) == {"a", "b"}:
        yield prefix, node
        return
    for key, child in node.items():
        yield from _pairs(child, f"{prefix}/{key}" if prefix else key)


def adapted_leaves(adapters: dict):
    """``(layer, parents, leaf, {"a", "b"})`` of every adapter (``parents``: the internal
    path's groups, ``("moe", "experts")`` for the experts' stacked adapters)."""
    for layer, block in adapters["blocks"].items():
        for path, pair in _pairs(block):
            *parents, leaf = path.split("/")
            yield layer, tuple(parents), leaf, pair


def _node(block: dict, parents) -> dict:
    """The dict at ``parents`` in ``block``, each dict on the way copied (the base's own
    trees are never changed)."""
    node = block
    for part in parents:
        node[part] = dict(node[part])
        node = node[part]
    return node


def adapted(base: dict, adapters: dict, settings: LoraSettings) -> dict:
    """The parameter tree :mod:`minifield.models.llama` runs: the base's, with every target
    matrix replaced by a :class:`minifield.models.layers.primitives.LoraWeight` (base matrix,
    A, B, scale); the experts' stacked adapters go to ``moe/experts_lora`` (base None:
    :mod:`minifield.models.moe` multiplies them in the experts' groups). A base held with its
    layers stacked (:func:`minifield.hf.stored_base.stacked`) gets the adapters stacked too
    (a copy of the adapters alone), so the scan slices the base where it lies."""
    from ..models.layers import layer_stack
    from ..models.layers.primitives import LoraWeight

    base = _model_params(base)
    if layer_stack.STACKED in base["blocks"]:  # a base held stacked (stored_base.stacked)
        adapters = layer_stack.stack_layers(adapters)
    params = {**base, "blocks": {k: dict(v) for k, v in base["blocks"].items()}}
    for layer, parents, leaf, pair in adapted_leaves(adapters):
        block = params["blocks"][layer]
        if parents == EXPERTS:
            node = _node(block, ("moe",))
            node["experts_lora"] = {**node.get("experts_lora", {})}
            node["experts_lora"][leaf] = LoraWeight(None, pair["a"], pair["b"], settings.scale)
            continue
        node = _node(block, parents)
        node[leaf] = LoraWeight(node[leaf], pair["a"], pair["b"], settings.scale)
    return params


def merged(base: dict, adapters: dict, settings: LoraSettings) -> dict:
    """FP32 parameters with the adapters merged: ``W + (alpha / rank) * A @ B`` per target
    (each expert's own ``A[j] @ B[j]``; FP32 products); every other parameter is the base's,
    as FP32."""
    import jax
    import jax.numpy as jnp

    from ..models.layers import layer_stack

    per_layer = layer_stack.per_layer(_model_params(base))  # a stacked base's layers
    params = jax.tree_util.tree_map(lambda a: a.astype(jnp.float32), per_layer)

    def delta(a, b):
        return settings.scale * jnp.matmul(a, b, precision=jax.lax.Precision.HIGHEST)

    for layer, parents, leaf, pair in adapted_leaves(adapters):
        node = _node(params["blocks"][layer], parents)  # tree_map made fresh dicts
        if parents == EXPERTS:  # expert by expert: the products (and bits) of one matrix
            w = node[leaf]
            node[leaf] = jnp.stack(
                [w[j] + delta(pair["a"][j], pair["b"][j]) for j in range(w.shape[0])]
            )
            continue
        node[leaf] = node[leaf] + delta(pair["a"], pair["b"])
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
