"""A random Llama base written as an HF checkpoint one group of tensors at a time
(``qlora_step.py``): host memory bounded by one group, never the whole model.

The groups, in the order a PyTorch ``state_dict`` gives them: the embeddings (group 0), each
decoder layer (group ``i + 1``: its attention, MLP and norms), then the final norm and the head
(group ``n_layers + 1``). Group ``g`` is drawn from its own ``np.random.default_rng([seed,
g])``, its tensors in PyTorch's order, each in HF's ``[out, in]`` layout as float32
``standard_normal`` times its std (``minifield.models.llama.init_params``' scales): embeddings
0.02, a matrix ``in ** -0.5``, the two residual writers (``o_proj``, ``down_proj``) also
``1 / sqrt(2 n_layers)``, the head ``d_model ** -0.5``, norms 1. Each group is rounded to the
stored dtype tensor by tensor and written as its own shard
(``model-0000g-of-0000N.safetensors``), then ``model.safetensors.index.json`` and
``config.json``: the sharded layout ``save_pretrained`` writes, read by the project's loader.

Each tensor is drawn in blocks of rows (:data:`DRAW_VALUES` FP32 values at a time), so the
host holds one group in the stored dtype, its serialised bytes, and one block. At the
Llama-3.1-8B shape a layer is 218M values (0.44 GB in BF16); the largest group is the
embeddings (525M values, 1.05 GB in BF16: 2.1 GB with its bytes for the file), against 16 GB
for the whole model in BF16 (32 GB in FP32).
This module imports no JAX: the benchmark's parent never starts a backend.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import numpy as np

from minifield import atomic
from minifield.hf import checkpoint, parallel_files, shards
from minifield.models.families import expected_tensors

#: FP32 values drawn at a time (64 MiB): a tensor's draw never holds it whole in FP32, and
#: the stream is the one a single draw of the tensor gives (NumPy's generator draws value by
#: value)
DRAW_VALUES = 1 << 24
_LAYER = re.compile(r"model\.layers\.(\d+)\.")
#: the residual writers, scaled down by 1 / sqrt(2 n_layers) as ``llama.init_params`` scales them
RESIDUAL_WRITERS = ("self_attn.o_proj.weight", "mlp.down_proj.weight")


def groups(cfg) -> list[list[str]]:
    """The HF tensor names of each group (embeddings, each layer, final norm and head), each
    in PyTorch's ``state_dict`` order."""
    out: list[list[str]] = [[] for _ in range(cfg.n_layers + 2)]
    for name in shards.torch_order(expected_tensors(cfg)):
        layer = _LAYER.match(name)
        if layer is not None:
            out[int(layer.group(1)) + 1].append(name)
        elif name == "model.embed_tokens.weight":
            out[0].append(name)
        else:
            out[-1].append(name)
    return out


def std(cfg, name: str, shape: tuple) -> float | None:
    """The std of a tensor's values (None: a norm's scale, all ones)."""
    if name.endswith("norm.weight"):
        return None
    if name == "model.embed_tokens.weight":
        return 0.02
    if len(shape) != 2:
        raise ValueError(f"{name}: a random base of this benchmark has no such tensor")
    scale = shape[1] ** -0.5  # HF's [out, in]: the fan-in is the second axis
    return scale / math.sqrt(2 * cfg.n_layers) if name.endswith(RESIDUAL_WRITERS) else scale


def draw_group(cfg, seed: int, group: int, names: list[str], dtype: str) -> dict:
    """The group's tensors (HF name -> array in ``dtype``), drawn as the module says."""
    rng = np.random.default_rng([seed, group])
    stored = parallel_files.stored_type(dtype)
    expected = expected_tensors(cfg)
    tensors = {}
    for name in names:
        shape = expected[name][2]
        sigma = std(cfg, name, shape)
        if sigma is None:
            tensors[name] = np.ones(shape, stored)
            continue
        tensors[name] = np.empty(shape, stored)
        rows = max(1, DRAW_VALUES // math.prod(shape[1:]))
        for start in range(0, shape[0], rows):  # the generator's stream, a block of rows at a time
            block = rng.standard_normal((min(rows, shape[0] - start), *shape[1:]), np.float32)
            block *= np.float32(sigma)
            tensors[name][start : start + rows] = block.astype(stored)
    return tensors


def write(directory: Path, cfg, seed: int = 0, dtype: str = "bfloat16") -> None:
    """The random base of ``cfg`` under ``directory`` (see the module), one group at a time;
    ``config.json`` last, so a directory holding it holds the whole base."""
    from safetensors.numpy import save

    directory.mkdir(parents=True, exist_ok=True)
    itemsize = np.dtype(parallel_files.stored_type(dtype)).itemsize
    expected = expected_tensors(cfg)
    named = groups(cfg)
    count = len(named)
    weight_map, total = {}, 0
    for group, names in enumerate(named):
        file = f"model-{group + 1:05d}-of-{count:05d}.safetensors"
        tensors = draw_group(cfg, seed, group, names, dtype)
        atomic.write_bytes(directory / file, save(tensors, metadata={"format": "pt"}))
        del tensors
        weight_map.update(dict.fromkeys(names, file))
        total += sum(math.prod(expected[n][2]) for n in names)
    metadata = {"total_parameters": total, "total_size": total * itemsize}
    index = {"metadata": metadata, "weight_map": weight_map}
    atomic.write_bytes(directory / shards.INDEX_FILE, shards.index_bytes(index))
    config = checkpoint.exported_config(cfg, dtype)
    atomic.write_bytes(
        directory / checkpoint.CONFIG_FILE, (json.dumps(config, indent=2) + "\n").encode()
    )
