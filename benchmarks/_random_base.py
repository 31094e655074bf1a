"""A random Llama base written as an HF checkpoint (``qlora_step.py``), drawn straight into its
files by threads: host memory bounded by a piece of a tensor a thread, never a layer.

The groups, in the order a PyTorch ``state_dict`` gives them: the embeddings (group 0), each
decoder layer (group ``i + 1``: its attention, MLP and norms), then the final norm and the head
(group ``n_layers + 1``); each group is its own shard (``model-0000g-of-0000N.safetensors``),
then ``model.safetensors.index.json`` and ``config.json``: the sharded layout
``save_pretrained`` writes, read by the project's loader. Tensor ``t`` of group ``g`` (its
place in the group, PyTorch's order) has its own generator, ``PCG64(SeedSequence([seed, g,
t]))``; its values, in HF's ``[out, in]`` C order, are drawn by inverse transform from the
generator's raw 64-bit outputs, four 16-bit words of each (low first), each word ``u`` the
value ``sigma * Phi^-1((u + 0.5) / 65536)`` rounded to the stored dtype: the normal
distribution's 65,536 equiprobable quantiles (within 4.3 sigma). ``sigma`` is
``minifield.models.llama.init_params``' scale: embeddings 0.02, a matrix ``in ** -0.5``, the
two residual writers (``o_proj``, ``down_proj``) also ``1 / sqrt(2 n_layers)``, the head
``d_model ** -0.5``; norms are 1.

So a value costs a table look-up, not a normal draw and a rounding (the draw and BF16 rounding
of the 3B base took 133 s of this CPU; docs/quantized-base.md), and a tensor's pieces
(:data:`DRAW_VALUES` values, the generator advanced to each) are drawn and written side by
side (NumPy's raw draw and ``take``, and ``os.pwrite``, release the GIL), each where the file
lays it out (:func:`minifield.hf.parallel_files.header`: the bytes the ``safetensors`` library
writes), each file synced (``fsync``) and renamed into place once whole.
This module imports no JAX: the benchmark's parent never starts a backend.
"""

from __future__ import annotations

import functools
import json
import math
import os
import re
import statistics
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from minifield import atomic
from minifield.hf import checkpoint, parallel_files, shards
from minifield.models.families import expected_tensors

#: values drawn at a time by a thread (one piece: 512 KiB of raw draws and of BF16 values);
#: a multiple of 4, so each piece starts on a raw output
DRAW_VALUES = 1 << 18
#: the 16-bit words' quantiles of the standard normal (float64)
QUANTILES = 1 << 16

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


@functools.cache
def _standard_quantiles() -> np.ndarray:
    """The standard normal's quantile of each 16-bit word, float64 (made once a process)."""
    normal = statistics.NormalDist()
    return np.array([normal.inv_cdf((u + 0.5) / QUANTILES) for u in range(QUANTILES)])


def _table(sigma: float, stored, cache: dict) -> np.ndarray:
    """A word's value for ``sigma``, in the stored dtype (see the module)."""
    if sigma not in cache:
        cache[sigma] = (np.float64(sigma) * _standard_quantiles()).astype(stored)
    return cache[sigma]


def _draw_piece(fd: int, at: int, key: list[int], start: int, stop: int, table) -> None:
    """Values ``[start, stop)`` of the tensor drawn from ``key``, written at byte ``at`` of
    the tensor's data (``start`` a multiple of 4: a raw output's first word)."""
    generator = np.random.PCG64(np.random.SeedSequence(key))
    generator.advance(start // 4)
    words = generator.random_raw(-(-(stop - start) // 4)).astype("<u8").view("<u2")
    values = np.take(table, words[: stop - start])
    os.pwrite(fd, values.view(np.uint8).data, at + start * table.itemsize)


class _Shard:
    """One group's file: created with its header and size, its norms written; its pieces
    counted as they are queued and as they are written; synced and renamed into place once
    every piece is written."""

    def __init__(self, directory: Path, file: str, shapes: dict, dtype: str):
        self.path, self.temporary = directory / file, directory / f".{file}.tmp"
        head, self.offsets, size = parallel_files.header(shapes, dtype, {"format": "pt"})
        self.fd = os.open(self.temporary, os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
        os.ftruncate(self.fd, size)
        os.pwrite(self.fd, head, 0)
        self.pending, self.queued = 0, False

    def written(self) -> None:
        """One piece written, or (``pending`` 0) every piece queued."""
        if self.queued and self.pending == 0:
            os.fsync(self.fd)
            os.close(self.fd)
            self.temporary.replace(self.path)


def _pieces(cfg, seed: int, group: int, shapes: dict, shard: _Shard, stored, tables: dict):
    """The ``_draw_piece`` arguments of a group's tensors (a norm's ones written here)."""
    for place, (name, shape) in enumerate(shapes.items()):
        sigma, count = std(cfg, name, shape), math.prod(shape)
        if sigma is None:
            os.pwrite(shard.fd, np.ones(count, stored).view(np.uint8).data, shard.offsets[name])
            continue
        table = _table(sigma, stored, tables)
        for start in range(0, count, DRAW_VALUES):
            stop = min(count, start + DRAW_VALUES)
            yield shard.fd, shard.offsets[name], [seed, group, place], start, stop, table


def write(directory: Path, cfg, seed: int = 0, dtype: str = "bfloat16", threads=None) -> None:
    """The random base of ``cfg`` under ``directory`` (see the module); ``config.json`` last,
    so a directory holding it holds the whole base. ``threads``: absent, one per CPU this
    process may run on (the values do not depend on it); at most 4 pieces a thread queued."""
    directory.mkdir(parents=True, exist_ok=True)
    stored = parallel_files.stored_type(dtype)
    expected = expected_tensors(cfg)
    named = groups(cfg)
    weight_map, total, tables, queued = {}, 0, {}, deque()
    threads = threads or len(os.sched_getaffinity(0))

    def retire() -> None:
        piece, shard = queued.popleft()
        piece.result()
        shard.pending -= 1
        shard.written()

    with ThreadPoolExecutor(threads) as pool:
        for group, names in enumerate(named):
            file = f"model-{group + 1:05d}-of-{len(named):05d}.safetensors"
            shapes = {name: expected[name][2] for name in names}
            shard = _Shard(directory, file, shapes, dtype)
            for args in _pieces(cfg, seed, group, shapes, shard, stored, tables):
                queued.append((pool.submit(_draw_piece, *args), shard))
                shard.pending += 1
                if len(queued) > 4 * threads:
                    retire()
            shard.queued = True
            shard.written()
            weight_map.update(dict.fromkeys(names, file))
            total += sum(math.prod(shape) for shape in shapes.values())
        while queued:
            retire()
    atomic.fsync_dir(directory)
    metadata = {"total_parameters": total, "total_size": total * np.dtype(stored).itemsize}
    index = {"metadata": metadata, "weight_map": weight_map}
    atomic.write_bytes(directory / shards.INDEX_FILE, shards.index_bytes(index))
    config = checkpoint.exported_config(cfg, dtype)
    atomic.write_bytes(
        directory / checkpoint.CONFIG_FILE, (json.dumps(config, indent=2) + "\n").encode()
    )
