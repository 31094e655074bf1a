"""A base model's weights as its checkpoint stores them, and the parameters the model runs.

A LoRA run never updates its base, so nothing needs FP32 masters of it, nor this project's
``[in, out]`` layout: the prepared examples keep each tensor in the checkpoint's own dtype
(BF16 stays BF16) and HF's ``[out, in]`` layout (:func:`to_arrays`), training memory-maps
them and puts them on the device unconverted (:func:`on_device`), and the jitted step makes the
parameters :mod:`minifield.models.llama` runs (:meth:`FrozenBase.model_params`): every leaf in the dtype the
base is held in (``base_dtype``; BF16 to FP32 is exact), each stored ``[out, in]`` matrix
transposed once per step into ``[in, out]``. That transpose is a real copy on purpose: left
to itself XLA folds it into the products' dimension numbers (``dot_general`` contracting
HF's layout directly), and XLA:CPU then sums in another order — FP32 logits differ in the
last bits (9.5e-7 on the test model) — so the step would no longer give the state hashes of
the transposed-at-load base; behind an ``optimization_barrier`` the products are the same
products. Its cost per step: ``benchmarks/hf_load.py``. Full fine-tuning widens and
transposes on the host instead (:func:`host_fp32`, with :mod:`.tensors`' block-wise widening):
its FP32 masters are trained.

The arrays: ``base.<path>`` per parameter (BF16 stored as its ``uint16`` bits: ``.npy`` has no
BF16) and ``base_layout_json``, per path its stored dtype and whether it is ``[out, in]``.
Prepared examples without ``base_layout_json`` (an older preparation, a two-stage link) hold
FP32 ``[in, out]`` arrays.
"""

from __future__ import annotations

import json

import numpy as np

PARAM_PREFIX = "base."
LAYOUT_ARRAY = "base_layout_json"

#: a stored dtype's name -> (the numpy dtype it is stored as in ``.npy``, its own dtype)
_NPY = {"bfloat16": "uint16", "float16": "float16", "float32": "float32"}


def release(value: np.ndarray) -> None:
    """Drop the pages of ``value``'s bytes from this process when it views a memory-mapped
    file, as the prepared base's arrays do (:func:`.tensors.drop_pages`); any other array:
    nothing. A pass over the whole base tensor by tensor (the merged export's) then holds about
    the tensors in hand, not every page read so far: on the chip's host a process's mapped file
    pages counted against its memory, and the 8B export ran the host's 40 GB down to its
    last 6 (docs/tpu.md)."""
    import mmap

    from .tensors import drop_pages

    owner = value
    while isinstance(owner, np.ndarray):
        owner = owner.base
    if not isinstance(owner, mmap.mmap) or value.size == 0:
        return
    low, high = np.lib.array_utils.byte_bounds(value)
    mapped = np.frombuffer(owner, np.uint8).ctypes.data
    try:
        drop_pages(owner, low - mapped, high - mapped)
    except (AttributeError, OSError):  # no madvise here, or the kernel refused: a hint only
        pass


def dtype_name(value: np.ndarray) -> str:
    return "bfloat16" if value.dtype.name == "bfloat16" else value.dtype.name


def flatten(tree, prefix=""):
    """``(path, leaf)`` in sorted order (the prepared arrays' order, whatever the files')."""
    for key in sorted(tree):
        value = tree[key]
        if isinstance(value, dict):
            yield from flatten(value, f"{prefix}{key}/")
        else:
            yield f"{prefix}{key}", value


def nest(items) -> dict:
    params: dict = {"blocks": {}}
    for path, value in items:
        node = params
        *parents, leaf = path.split("/")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return params


def to_arrays(params: dict, stored_layout: dict[str, bool]) -> dict[str, np.ndarray]:
    """The prepared arrays of a base read by :func:`.checkpoint.load_stored` (see the
    module): the bytes as stored, nothing converted."""
    arrays, layout = {}, {}
    for path, value in flatten(params):
        name = dtype_name(value)
        arrays[PARAM_PREFIX + path.replace("/", ".")] = value.view(_NPY[name])
        layout[path] = {"dtype": name, "out_in": bool(stored_layout[path])}
    arrays[LAYOUT_ARRAY] = np.frombuffer(json.dumps(layout, sort_keys=True).encode(), np.uint8)
    return arrays


def stored(arrays: dict[str, np.ndarray]):
    """``(path, array in its own dtype, out_in)`` of every base parameter."""
    from ..models.expert_slots import expert_slot

    layout = None
    if LAYOUT_ARRAY in arrays:
        layout = json.loads(np.asarray(arrays[LAYOUT_ARRAY]).tobytes())
    experts: dict = {}
    for name, value in arrays.items():
        if not name.startswith(PARAM_PREFIX):
            continue
        path = name[len(PARAM_PREFIX) :].replace(".", "/")
        entry = {"dtype": "float32", "out_in": False} if layout is None else layout[path]
        if entry["dtype"] == "bfloat16":  # (no layout: FP32 [in, out], see the module)
            import ml_dtypes

            value = value.view(ml_dtypes.bfloat16)
        slot = expert_slot(path)
        if slot is not None:  # prepared when experts were held one by one: stacked here
            experts.setdefault(slot[0], {})[slot[1]] = (value, entry["out_in"])
            continue
        yield path, value, entry["out_in"]
    for path, held in experts.items():
        yield path, np.stack([held[j][0] for j in sorted(held)]), held[0][1]


class FP32Slices:
    """A stored base tensor seen as this project's FP32 ``[in, out]`` array, widened slice by
    slice where it is read: ``value[index]`` converts only the stored bytes of that slice (what
    :func:`minifield.training.data_parallel.place` asks for each device), ``numpy.asarray`` the
    whole. The values are :func:`.tensors.to_fp32`'s (widening and transposing are exact, so a
    slice's values are those of the whole array's slice)."""

    def __init__(self, data: np.ndarray, transpose: bool):
        self.data, self.transpose = data, transpose
        lead, matrix = data.shape[:-2], data.shape[-2:]  # lead: stacked experts' [E]
        self.shape = tuple(lead + matrix[::-1]) if transpose else tuple(data.shape)
        self.dtype = np.dtype(np.float32)

    def __getitem__(self, index) -> np.ndarray:
        from .tensors import to_fp32

        index = index if isinstance(index, tuple) else (index,)
        if self.transpose:  # the matrix's two axes swapped, any leading (experts') axis kept
            index += (slice(None),) * (len(self.shape) - len(index))
            index = index[:-2] + index[-2:][::-1]
        return to_fp32(np.ascontiguousarray(self.data[index]), self.transpose)

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        from .tensors import to_fp32

        value = to_fp32(self.data, self.transpose)
        return value if dtype is None else value.astype(dtype)


def host_fp32(arrays: dict[str, np.ndarray], by_slices: bool = False) -> dict:
    """The nested FP32 ``[in, out]`` parameter tree (host numpy) of prepared base arrays: the
    stored values widened exactly, matrices transposed (full fine-tuning's masters), block by
    block and tensors side by side (:func:`.tensors.to_fp32`); an FP32 array already in this
    project's layout stays the prepared (memory-mapped, read-only) array. ``by_slices``: each
    tensor left stored, an :class:`FP32Slices` converted slice by slice as it is placed (a
    sharded mesh: a process converts only its devices' slices, never the whole model)."""
    from .tensors import reading_pool, to_fp32

    entries = list(stored(arrays))
    if by_slices:
        return nest(
            (path, value if value.dtype == np.float32 and not out_in else FP32Slices(value, out_in))
            for path, value, out_in in entries
        )
    with reading_pool(len(entries)) as pool:
        values = list(pool.map(lambda item: to_fp32(item[1], item[2]), entries))
    return nest((path, value) for (path, _, _), value in zip(entries, values, strict=True))


def on_device(arrays: dict[str, np.ndarray], base_dtype: str) -> FrozenBase:
    """The base of prepared arrays on the device as stored (one copy from the memory-mapped
    files, no conversion), held in ``base_dtype`` by the step. A quantized base:
    :func:`minifield.hf.quantized_base.on_device`."""
    import jax

    return on_host(arrays, base_dtype, put=jax.device_put)


def on_host(arrays: dict[str, np.ndarray], base_dtype: str, put=lambda value: value) -> FrozenBase:
    """The base of prepared arrays as stored, still the host's (memory-mapped) arrays: what a
    data-parallel run places on its mesh slice by slice
    (:func:`minifield.training.data_parallel.place_tree`); ``put`` each array first."""
    items, out_in = [], set()
    for path, value, transposed in stored(arrays):
        items.append((path, put(value)))
        if transposed:
            out_in.add(path)
    return FrozenBase(nest(items), frozenset(out_in), base_dtype)


def zeros(cfg, dtype: str) -> FrozenBase:
    """A base of ``cfg``'s checkpoint tensors (HF's names, shapes and ``[out, in]`` layout),
    zeros in ``dtype``, held as stored: what a one-device LoRA run places, for measuring a
    step without a base's files (under ``jax.eval_shape`` nothing is allocated)."""
    import jax.numpy as jnp

    from ..models import expert_slots, families

    params: dict = {"blocks": {}}
    out_in = set()
    for path, transpose, shape in families.expected_tensors(cfg).values():
        slot = expert_slots.expert_slot(path)
        if slot is not None:  # the experts stacked, each [out, in] as stored
            path, shape = slot[0], (cfg.n_experts, *shape)
        expert_slots.put(params, path, jnp.zeros(shape, dtype), cfg.n_experts)
        if transpose:
            out_in.add(path)
    return FrozenBase(params, frozenset(out_in), dtype)


def stacked(base: FrozenBase) -> FrozenBase:
    """``base`` as a step that scans its layers (``model.scan_layers``) runs it, made once as
    the base is placed: each block leaf's layers stacked along a leading axis
    (:data:`minifield.models.layers.layer_stack.STACKED`) and each stacked matrix stored
    ``[out, in]`` transposed into ``[in, out]`` here, on the device. Otherwise the step itself
    would stack the layers (and transpose them) every step: a second copy of the base's blocks
    held for the whole step (docs/quantized-base.md). An untied head stored ``[out, in]`` is
    transposed here once too (the step would copy it every step: 1 GB at Llama-3.1-8B's
    vocabulary, docs/tpu.md). The values are the stored values moved,
    so the step's products, and its bits, are the per-layer base's. ``base`` is consumed: each
    leaf's per-layer arrays are let go as soon as they are stacked, so placing it holds at most
    one leaf's layers twice (a quantized matrix's codes and scales are stacked as they are)."""
    from ..models.layers.layer_stack import STACKED, layer_names

    blocks = base.params["blocks"]
    names = layer_names(blocks)
    if names == [STACKED]:
        return base
    params = dict(base.params)
    for path in sorted(p for p in base.out_in if not p.startswith("blocks/")):  # the head
        parent, leaf = path.rsplit("/", 1)
        node = params
        for part in parent.split("/"):
            node = node[part]
        node[leaf] = _transposed(node.pop(leaf))
    items = []
    for path, _ in list(flatten(blocks[names[0]])):
        transpose = f"blocks/{names[0]}/{path}" in base.out_in
        layers = [_pop(blocks[name], path.split("/")) for name in names]
        items.append((path, _stack_layers(transpose, *layers)))
        del layers
    params["blocks"] = {STACKED: nest(items)}
    del params["blocks"][STACKED]["blocks"]  # (nest's own empty "blocks")
    return FrozenBase(params, frozenset(), base.dtype, base.host)


def _pop(node: dict, parts: list[str]):
    """The leaf at ``parts`` in ``node``, taken out of it (the caller's reference is the last)."""
    for part in parts[:-1]:
        node = node[part]
    return node.pop(parts[-1])


def _transposed(matrix):
    import jax
    import jax.numpy as jnp

    return jax.jit(lambda w: jnp.swapaxes(w, -1, -2))(matrix)


def _stack_layers(transpose: bool, *layers):
    import jax
    import jax.numpy as jnp

    def stack(*leaves):
        return jnp.stack([jnp.swapaxes(leaf, -1, -2) if transpose else leaf for leaf in leaves])

    return jax.jit(lambda *ls: jax.tree_util.tree_map(stack, *ls))(*layers)


#: registered as a pytree on first use (importing this module must not import JAX: the
#: prepare stage and recipe validation use it)
_registered: list[bool] = []


class FrozenBase:
    """Stored base weights (a pytree, so it passes into jitted steps as an argument):
    ``params`` as stored, ``out_in`` the paths held ``[out, in]``, ``dtype`` the dtype the
    model sees them in, ``host`` the paths held in the host's memory (their rows gathered
    there: :class:`~minifield.models.host_table.HostTable`)."""

    def __init__(self, params: dict, out_in: frozenset, dtype: str, host=frozenset()):
        self.params, self.out_in, self.dtype, self.host = params, out_in, dtype, host
        if not _registered:
            import jax

            jax.tree_util.register_pytree_node_class(FrozenBase)
            _registered.append(True)

    def tree_flatten(self):
        return (self.params,), (self.out_in, self.dtype, self.host)

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls(children[0], *aux)

    def model_params(self) -> dict:
        """The parameters :mod:`minifield.models.llama` runs (``[in, out]``, in ``dtype``), made inside the
        jitted function (see the module for why the transposes are copies)."""
        import jax
        import jax.numpy as jnp

        dtype = jnp.bfloat16 if self.dtype == "bfloat16" else jnp.float32

        from ..models.host_table import HostTable
        from ..models.quantize import QuantizedWeight

        def made(path, value):
            if isinstance(value, QuantizedWeight):  # made back inside each layer's products
                return value.held_in(self.dtype)
            if path in self.host:  # in the host's memory: its rows gathered there
                return HostTable(value, dtype)
            if path in self.out_in:  # in the stored dtype: the fewest bytes to move (the
                # experts' stacked [E, out, in]: each expert's matrix transposed)
                value = jax.lax.optimization_barrier(jnp.swapaxes(value, -1, -2))
            return value.astype(dtype)

        return nest((path, made(path, value)) for path, value in flatten(self.params))


#: the block matrices the quantizer knows (QLoRA's linear layers); every dense family this
#: project reads has these alone (Phi-3's fused ones are stored as their parts)
QUANTIZED_MATRICES = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")


def config_quantization_problem(section: dict, cfg, config: dict) -> str | None:
    """What ``model.lora.base_quantization`` cannot quantize in a base, from its
    ``config.json`` alone (``cfg`` read from it): experts or another layer the quantizer does
    not know (named by ``model_type``), a base already quantized, a block that does not divide
    a matrix's inputs. None: nothing."""
    from ..models import quantize
    from ..models.families import expected_tensors

    scheme = section.get("base_quantization", "none")
    if scheme == "none":
        return None
    field = f"model.lora.base_quantization {scheme}"
    model_type = config.get("model_type", "(none)")
    if cfg.n_experts:
        return (
            f"model_type {model_type} is a mixture of experts: {field} is not supported on "
            "experts (use a dense base)"
        )
    if "quantization_config" in config:
        return (
            f"the base is already quantized (quantization_config); {field} needs the "
            "unquantized float32, bfloat16 or float16 checkpoint"
        )
    for name, (internal, transpose, shape) in expected_tensors(cfg).items():
        paths = (internal,) if isinstance(internal, str) else internal
        if not quantize.is_quantized(paths[0], len(shape)):
            continue
        unknown = [p for p in paths if p.rsplit("/", 1)[-1] not in QUANTIZED_MATRICES]
        if unknown:
            return (
                f"model_type {model_type}: the layer's tensor {name} is not a matrix {field} "
                f"knows (it quantizes {', '.join(QUANTIZED_MATRICES)})"
            )
        in_out = tuple(shape[::-1]) if transpose else tuple(shape)  # fused: its parts' inputs
        problem = quantize.check_block(in_out, scheme, section.get("quantization_block"))
        if problem:
            return (
                f"tensor {paths[0]} {list(in_out)}: {problem}; model.lora.quantization_block "
                "must divide every quantized matrix's input dimension"
            )
    return None


def quantization_problem(section: dict, cfg, config: dict, params, stored_layout) -> str | None:
    """What ``model.lora.base_quantization`` cannot quantize in a base (its config, its
    stored tensors): a matrix stored in another dtype, or
    :func:`config_quantization_problem`'s. None: nothing."""
    from ..models import quantize

    scheme = section.get("base_quantization", "none")
    if scheme == "none":
        return None
    for path, value in flatten(params):
        if not quantize.is_quantized(path, value.ndim):
            continue
        dtype = dtype_name(value)
        if dtype not in ("float32", "bfloat16", "float16"):
            return (
                f"tensor {path} is stored as {dtype}; model.lora.base_quantization {scheme} "
                "needs a float32, bfloat16 or float16 base"
            )
    return config_quantization_problem(section, cfg, config)
