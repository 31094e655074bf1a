"""HuggingFace Llama-family checkpoints in and out: ``config.json`` + safetensors.

Reading goes through the ``safetensors`` library only; pickle formats (``.bin``, ``.pt``,
``.ckpt``, ``.pth``) are refused, never unpickled. :func:`load` converts tensors to FP32 (F32,
BF16 and F16 are accepted) straight from the memory-mapped file (:mod:`.tensors`), a few side
by side (:func:`.tensors.reading_pool`: one thread each), so the load holds at most those
tensors' source pages beside the FP32 result;
:func:`load_stored` reads them as stored (dtype and layout), one pass over the bytes. Every shape is checked against ``config.json`` (read by :mod:`.config`)
before any tensor is read, and every value is checked to be finite.

:data:`minifield.models.families.NAME_TABLE` is the one mapping between HF (PyTorch) tensor names and this
project's parameter paths (see :mod:`minifield.models.llama`), for every family :mod:`minifield.models.families` lists.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

from .. import atomic

# the tensor tables and config.json's reading and writing; the names are this module's too
# (one loader API)
from ..models.expert_slots import at, expert_slot, put
from ..models.families import (
    ARCHITECTURES,
    expected_tensors,
    fp32_bytes,
    join,
    param_shape,
    shape_fields,
    split,
    split_stored,
)
from ..models.llama_config import LlamaConfig
from . import parallel_files, shards
from .config import CONFIG_FILE, CheckpointError, config_from_hf, config_to_hf
from .tensors import (
    ACCEPTED_DTYPES,
    Source,
    data_offsets,
    read_fp32,
    read_stored,
    reading_pool,
    source_dtype_of,
)

__all__ = [
    "ARCHITECTURES",
    "CONFIG_FILE",
    "EXPORT_DTYPES",
    "CheckpointError",
    "config_from_hf",
    "config_to_hf",
    "expected_tensors",
    "exported_config",
    "fp32_bytes",
    "load",
    "load_stored",
    "write",
]

SINGLE_FILE, INDEX_FILE = shards.SINGLE_FILE, shards.INDEX_FILE
PICKLE_SUFFIXES = (".bin", ".pt", ".ckpt", ".pth", ".pkl")

# ----------------------------------------------------------------------------- reading


def _refuse_pickles(directory: Path) -> None:
    pickles = sorted(p.name for p in directory.iterdir() if p.suffix in PICKLE_SUFFIXES)
    if pickles and not (directory / SINGLE_FILE).exists() and not (directory / INDEX_FILE).exists():
        raise CheckpointError(
            f"{directory / pickles[0]}: pickle checkpoints are refused (unpickling runs "
            f"arbitrary code); convert the model to safetensors ({SINGLE_FILE})"
        )


def _tensor_files(directory: Path) -> dict[str, Path]:
    """HF tensor name -> the safetensors file holding it (single file or sharded index)."""
    from safetensors import safe_open

    index_path = directory / INDEX_FILE
    if index_path.exists():
        try:
            weight_map = json.loads(index_path.read_text())["weight_map"]
        except (ValueError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index_path}: not a safetensors index ({e})") from None
        files = {}
        for name, shard in weight_map.items():
            shard_path = directory / shard
            if Path(shard).suffix != ".safetensors" or shard_path.parent != directory:
                raise CheckpointError(
                    f"{index_path}: tensor {name} names shard {shard!r}, not a .safetensors "
                    "file in this directory"
                )
            if not shard_path.is_file():
                raise CheckpointError(f"{index_path}: tensor {name} names missing shard {shard}")
            files[name] = shard_path
        return files
    single = directory / SINGLE_FILE
    if not single.is_file():
        raise CheckpointError(f"{directory}: neither {SINGLE_FILE} nor {INDEX_FILE} found")
    with safe_open(single, framework="numpy") as f:
        return dict.fromkeys(f.keys(), single)


def _checked(directory: Path, max_len, compute_dtype):
    """``(cfg, expected tensors, tensor name -> file, names by file, duplicate head)`` of an
    HF directory, every name, shape and dtype checked from the headers alone (see :func:`load`),
    so a bad checkpoint fails before any tensor is read."""
    from safetensors import safe_open

    if directory.suffix in PICKLE_SUFFIXES:
        raise CheckpointError(
            f"{directory}: pickle checkpoints are refused (unpickling runs arbitrary code); "
            f"give an HF directory with {SINGLE_FILE}"
        )
    if not directory.is_dir():
        raise CheckpointError(f"{directory}: not a directory")
    _refuse_pickles(directory)
    config_path = directory / CONFIG_FILE
    try:
        hf = json.loads(config_path.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{config_path}: cannot read ({e})") from None
    cfg = config_from_hf(hf, str(config_path), max_len, compute_dtype)
    expected = expected_tensors(cfg)
    files = _tensor_files(directory)
    present = set(files)
    duplicate_head = cfg.tie_embeddings and "lm_head.weight" in present
    if duplicate_head:
        present.discard("lm_head.weight")  # some tied checkpoints store the shared matrix twice
    missing = sorted(set(expected) - present)
    if missing:
        raise CheckpointError(f"{directory}: tensor {missing[0]} missing ({len(missing)} in all)")
    unexpected = sorted(present - set(expected))
    if unexpected:
        raise CheckpointError(
            f"{files[unexpected[0]]}: unexpected tensor {unexpected[0]} "
            f"({len(unexpected)} in all) for the model config.json describes"
        )
    by_file: dict[Path, list[str]] = {}
    for name in expected:
        by_file.setdefault(files[name], []).append(name)
    for path, names in by_file.items():
        with safe_open(path, framework="numpy") as f:
            for name in names:
                info = f.get_slice(name)
                shape, dtype = tuple(info.get_shape()), info.get_dtype()
                if shape != expected[name][2]:
                    raise CheckpointError(
                        f"{path}: tensor {name} has shape {list(shape)}, config.json implies "
                        f"{list(expected[name][2])} ({shape_fields(*expected[name][:2])})"
                    )
                if dtype not in ACCEPTED_DTYPES:
                    raise CheckpointError(
                        f"{path}: tensor {name} has dtype {dtype} "
                        f"(accepted: {sorted(ACCEPTED_DTYPES)})"
                    )
    return cfg, expected, files, by_file, duplicate_head


def _read_all(directory, max_len, compute_dtype, read, parts, only=None) -> tuple:
    """``(cfg, params, expected)``: every tensor through ``read(source, name, start, end,
    shape, kind, transpose)``, cut into its parameters by ``parts(cfg, path, value)``;
    ``only``: just the tensors whose (first) internal path it accepts (every check of the
    headers as ever)."""
    from safetensors import safe_open

    directory = Path(directory)
    cfg, expected, files, by_file, duplicate_head = _checked(directory, max_len, compute_dtype)
    if only is not None:
        by_file = {
            path: [n for n in names if only(_first_path(expected[n][0]))]
            for path, names in by_file.items()
        }
        by_file = {path: names for path, names in by_file.items() if names}
        duplicate_head = duplicate_head and only(
            _first_path(expected["model.embed_tokens.weight"][0])
        )
    params: dict = {}
    for path, names in by_file.items():
        offsets = data_offsets(path)
        with Source(path) as source, reading_pool(len(names)) as pool:

            def one(name, source=source, offsets=offsets):
                internal, transpose, shape = expected[name]
                start, end, kind = offsets[name]
                return internal, read(source, name, start, end, shape, kind, transpose)

            # tensors read side by side (numpy's copies and the reads release the GIL); in
            # order, so the first bad tensor is the one named
            for internal, value in pool.map(one, names):
                for part_path, part in parts(cfg, internal, value):  # fused: several
                    try:  # an expert's tensor: into its stacked parameter
                        put(params, part_path, part, cfg.n_experts)
                    except ValueError as e:
                        raise CheckpointError(f"{path}: {e}") from None
                del value
    if duplicate_head:
        path = files["lm_head.weight"]
        with safe_open(path, framework="numpy") as f:
            head = f.get_tensor("lm_head.weight")
        if head.shape != expected["model.embed_tokens.weight"][2] or not np.array_equal(
            head.astype(np.float32), np.asarray(params["embed"]["tokens"], np.float32)
        ):
            raise CheckpointError(
                f"{path}: tensor lm_head.weight differs from model.embed_tokens.weight, but "
                "config.json says tie_word_embeddings"
            )
    params.setdefault("blocks", {})
    return cfg, params, expected


def _first_path(internal) -> str:
    """A tensor's internal path (a fused one's first part: its parts share their layer)."""
    return internal if isinstance(internal, str) else internal[0]


def load(directory: str | Path, max_len: int | None = None, compute_dtype="bfloat16", only=None):
    """``(LlamaConfig, FP32 params)`` from an HF checkpoint directory; ``only``: a predicate
    on internal parameter paths (``"blocks/03/attn/wq"``), just those parameters read (a
    layer at a time: :class:`minifield.hf.directory.LayerFiles`).

    Raises :class:`CheckpointError` naming the file and tensor for a pickle file, an
    unsupported config, a missing or unexpected tensor, a shape disagreeing with
    ``config.json``, an unsupported dtype, a non-finite value, or an index naming a missing
    shard.
    """
    import jax

    def read(source, name, start, end, shape, kind, transpose):
        value = read_fp32(source, start, end, shape, source_dtype_of(kind), transpose, name)
        return value

    def placed(value):
        # may_alias: the aligned host buffer becomes the CPU array without a copy
        return jax.device_put(value, may_alias=True)

    def parts(cfg, internal, value):  # an expert's tensor stays on the host to be stacked
        return [(p, v if expert_slot(p) else placed(v)) for p, v in split(cfg, internal, value)]

    cfg, params, _ = _read_all(directory, max_len, compute_dtype, read, parts, only)
    stacked = lambda v: placed(v) if isinstance(v, np.ndarray) else v  # noqa: E731
    return cfg, jax.tree_util.tree_map(stacked, params)


def load_stored(directory: str | Path, max_len: int | None = None, compute_dtype="bfloat16"):
    """``(LlamaConfig, params, stored_layout)``: the tensors as the checkpoint stores them —
    their own dtype (BF16 stays BF16), HF's ``[out, in]`` layout for the matrices
    ``stored_layout`` names (internal path -> True; the experts stacked ``[E, out, in]``) — as
    aligned host arrays, nothing
    converted; :meth:`minifield.hf.stored_base.FrozenBase.model_params` makes them this project's parameters inside
    a jitted function. The same checks and errors as :func:`load`."""

    def read(source, name, start, end, shape, kind, transpose):
        return read_stored(source, start, end, shape, kind, name)

    cfg, params, expected = _read_all(directory, max_len, compute_dtype, read, split_stored)
    return cfg, params, _stored_layout(expected)


def map_stored(directory: str | Path, max_len: int | None = None, compute_dtype="bfloat16"):
    """:func:`load_stored`'s triple with each tensor a read-only memory map of its bytes in
    the file: nothing read until it is used, and so no check of the values (finite); the
    files' names, shapes and sizes checked as :func:`load_stored` checks them. For a base the
    host wrote itself (``benchmarks/qlora_step.py``: each mode's process maps the base, where
    reading it took 27 s of this CPU at Llama-3.2-3B)."""

    def read(source, name, start, end, shape, kind, transpose):
        dtype = source_dtype_of(kind)
        if end - start != math.prod(shape) * dtype.itemsize:
            raise CheckpointError(
                f"{source.path}: tensor {name}'s data size disagrees with its shape"
            )
        return np.memmap(source.path, dtype, "r", offset=start, shape=tuple(shape))

    cfg, params, expected = _read_all(directory, max_len, compute_dtype, read, split_stored)
    return cfg, params, _stored_layout(expected)


def _stored_layout(expected) -> dict[str, bool]:
    stored_layout = {}
    for internal, transpose, _ in expected.values():
        for path in (internal,) if isinstance(internal, str) else internal:
            slot = expert_slot(path)
            stored_layout[path if slot is None else slot[0]] = transpose
    return stored_layout


# ----------------------------------------------------------------------------- writing


#: tensor dtypes :func:`write` can store (the ``torch_dtype`` written in ``config.json``)
EXPORT_DTYPES = ("float32", "bfloat16", "float16")


def write(
    directory: str | Path,
    cfg: LlamaConfig,
    params,
    dtype: str = "float32",
    base_config: dict | None = None,
    max_shard_size: int | None = None,
    fetch=np.asarray,
    group=None,
) -> None:
    """Write ``params`` as PyTorch-named safetensors plus ``config.json``: one
    ``model.safetensors``, or with ``max_shard_size`` (bytes; None: one file whatever the
    size) the shards and index Hugging Face's ``save_pretrained`` writes (:mod:`.shards`).

    ``dtype``: the stored tensors' type; FP32 values are rounded to nearest (ties to even) by
    ``ml_dtypes``/numpy for ``bfloat16``/``float16``. ``fetch``: a parameter leaf -> its host
    array, called as each tensor is converted (a device array is fetched then, not the whole
    tree first), from several threads at once; each tensor is written as soon as it is
    converted: the writer holds the tensors being converted, never a shard.

    ``group``: the processes of a state spread over several (a collective: every process
    calls it): each writes the slices its devices hold into the files process 0 laid out
    (:mod:`.parallel_files`; no tensor gathered, ``fetch`` unused), and process 0 alone
    writes the index and ``config.json`` once every part is durable."""
    if dtype not in EXPORT_DTYPES:
        raise ValueError(f"export dtype {dtype!r}: expected one of {EXPORT_DTYPES}")
    stored_dtype = parallel_files.stored_type(dtype)

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    expected = expected_tensors(cfg)
    elements = {name: math.prod(shape) for name, (_, _, shape) in expected.items()}
    itemsize = np.dtype(stored_dtype).itemsize
    # planned in the PyTorch model's state_dict order, as save_pretrained plans; one file keeps
    # the table's order (the bytes are the same: safetensors orders its header itself)
    sizes = {name: elements[name] * itemsize for name in shards.torch_order(expected)}
    planned = shards.plan(sizes, max_shard_size, elements)
    if planned.index is None:
        planned = shards.Plan({SINGLE_FILE: list(expected)}, None)

    def lookup(path: str):  # an expert's: its slice of the stacked leaf, then fetched
        return np.asarray(fetch(at(params, path)), dtype=np.float32)

    if group is not None:
        files = {
            file: {name: _spread_tensor(cfg, expected[name], params) for name in names}
            for file, names in planned.files.items()
        }
        parallel_files.write(directory, files, dtype, {"format": "pt"}, group)
        if group.rank != 0:
            return
    else:
        _write_files(directory, planned, expected, lambda path: join(path, lookup), dtype)
    if planned.index is not None:
        atomic.write_bytes(directory / INDEX_FILE, shards.index_bytes(planned.index))
    config = exported_config(cfg, dtype, base_config)
    atomic.write_bytes(directory / CONFIG_FILE, (json.dumps(config, indent=2) + "\n").encode())


def _write_files(directory: Path, planned, expected, value_of, dtype: str) -> None:
    """Each planned file from the whole tensors (``value_of(internal path)``: ``[in, out]``),
    streamed (:func:`.parallel_files.write_streamed`): a shard's tensors converted side by
    side by the reading pool's threads (:func:`.tensors.reading_pool`; each whole by one
    thread, so the bytes do not depend on the threads), each written into the file as soon
    as it is converted and then freed. The host holds the tensors being converted, never a
    shard: at 8B a shard is gigabytes, and the host also holds the run (docs/quantized-base.md)."""
    from .tensors import reading_pool

    stored_dtype = parallel_files.stored_type(dtype)

    def converted(name: str) -> np.ndarray:
        internal, transpose, shape = expected[name]
        raw = value_of(internal)
        value = raw.T if transpose else raw
        if value.shape != shape:
            raise ValueError(f"parameter {internal}: shape {raw.shape} disagrees with the config")
        return value.astype(stored_dtype, order="C")  # one pass, where a transposed view

    widest = max(len(names) for names in planned.files.values())
    with reading_pool(widest) as pool:
        for file, names in planned.files.items():
            shapes = {name: expected[name][2] for name in names}
            parallel_files.write_streamed(
                directory / file, shapes, dtype, {"format": "pt"}, converted, pool
            )


def _spread_tensor(cfg, entry, params) -> parallel_files.Tensor:
    """The :class:`.parallel_files.Tensor` of one HF tensor (``entry``: its
    :func:`expected_tensors` entry): its parameter, a fused matrix's parts side by side, or
    an expert's slice of the stacked experts (its index into their first axis)."""
    internal, transpose, shape = entry
    sources, column = [], 0
    for path in (internal,) if isinstance(internal, str) else internal:
        slot = expert_slot(path)
        held, lead = (path, None) if slot is None else slot
        value = at(params, held)
        if tuple(value.shape) != param_shape(cfg, held):
            raise ValueError(f"parameter {held}: shape {value.shape} disagrees with the config")
        sources.append(parallel_files.Source(value, lead, column, transpose))
        column += value.shape[-1] if len(value.shape) > 1 else 0
    return parallel_files.Tensor(tuple(shape), tuple(sources))


def exported_config(cfg: LlamaConfig, dtype: str, base_config: dict | None = None) -> dict:
    """The ``config.json`` :func:`write` writes: a base model's (``base_config``) fields all
    kept but the ones the run sets, the stored dtype (``torch_dtype``, and ``dtype``,
    transformers' newer name, where the base has it); without a base, :func:`config_to_hf`'s."""
    if base_config is None:
        return {**config_to_hf(cfg), "torch_dtype": dtype}
    out = {**base_config, "torch_dtype": dtype}
    if "dtype" in base_config:
        out["dtype"] = dtype
    return out
