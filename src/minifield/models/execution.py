"""How the model computes, as opposed to what it computes: attention kernel, layer loop,
rematerialisation and loss chunking.

Four recipe fields select it (see docs/model.md, "Execution options")::

    model.attention: xla | pallas        # absent: xla
    model.scan_layers: true | false      # absent: false
    training.remat: none | full | dots_saveable | save_attention | offload_attention
                                                  # absent: none
    training.loss_chunk_tokens: N        # absent or 0: the whole batch at once

Every option computes the same mathematics as the default; the floating-point bits may differ
(another kernel, another fusion, another summation order), so a value other than the default is
part of the computation digest. A value equal to the default is removed from the recipe when it
is checked (:func:`normalize_recipe`), so recipes written before these fields, and recipes that
spell the defaults out, keep their computation digest.

A recipe that names the TPU (``runtime.backend: tpu``) gets the memory options of
:data:`ACCELERATOR_DEFAULTS` where it leaves them out: on a 16 GB chip a useful step does not
fit without them. Its attention too: splash (``pallas``) where it measured faster than the XLA
path (:func:`tpu_default_attention`). They are filled in when the recipe is checked, so they are written in the
validated recipe and enter its digest like any spelled-out value: the run is reproducible from
its recipe, and every recipe that does not name the TPU (all CPU ones) keeps its digest.

The experts' grouped product follows the backend the same way (:func:`grouped_kernel`):
``jax.lax.ragged_dot`` on a TPU, the tiled product elsewhere; no recipe field selects it.
So does a quantized base's product (:func:`quantized_kernel`): XLA's, everywhere, until the
chip measures the Pallas kernel faster; a benchmark may force it (``Execution.quantized_kernel``).

``model.attention: pallas`` means the backend's fused kernel (:func:`fused_kernel`): splash
attention on a TPU (a recipe with ``runtime.backend: tpu``), the GPU flash-attention kernel
elsewhere. Each has its own rules for a row's length, windows and soft-capping, and splash
computes in BF16 only (:func:`splash_fp32_problem`), checked here against the backend the
recipe names, so a recipe is refused before anything runs.

The options ride on the model config (``cfg.execution``) because the config is what every
forward, loss and jit already receives; they are not part of the architecture, so ``to_dict``
(exports, base-model descriptions) leaves them out and an exported model computes with the
defaults. This module does not import JAX (recipes are checked without it).
"""

from __future__ import annotations

from dataclasses import dataclass

from .. import schemas

ATTENTION_KINDS = ("xla", "pallas")
REMAT_POLICIES = ("none", "full", "dots_saveable", "save_attention", "offload_attention")

#: the backends a recipe can name (``runtime.backend``)
BACKENDS = ("cpu", "gpu", "tpu", "any")

#: block sizes of the GPU fused (Pallas) attention kernel: forward query/key blocks, and the
#: backward pass's blocks; each is capped at the row length, which it must divide
PALLAS_FORWARD_BLOCK = 128
PALLAS_BACKWARD_BLOCK = 32

#: splash's own block sizes (``BlockSizes.get_default()``): what a row gets where
#: :data:`SPLASH_BLOCKS` has no measured entry for it
SPLASH_DEFAULT_BLOCKS = {
    "block_q": 128,
    "block_kv": 128,
    "block_kv_compute": 128,
    "block_q_dkv": 128,
    "block_kv_dkv": 128,
    "block_kv_dkv_compute": 128,
    "block_q_dq": 128,
    "block_kv_dq": 128,
}


def _blocks(*sizes: int) -> dict:
    """Splash's eight block sizes in :data:`SPLASH_DEFAULT_BLOCKS`' order."""
    return dict(zip(SPLASH_DEFAULT_BLOCKS, sizes, strict=True))


#: splash's block sizes measured on the chip, ``{row length: {head width: sizes}}``: the
#: ``best`` of ``benchmarks/splash_blocks.py``'s sweep on a TPU v5e (2026-12-06,
#: ``docs/splash-blocks.json``; figures in ``docs/tpu.md``), each kernel's blocks swept on its
#: own, joined, and kept only where the joined step beat every block at 512 (else all 512).
#: Every other shape gets :data:`SPLASH_DEFAULT_BLOCKS` (:func:`splash_blocks`).
SPLASH_BLOCKS = {
    128: {
        64: _blocks(128, 128, 128, 128, 128, 128, 128, 128),
        128: _blocks(128, 128, 128, 128, 128, 128, 128, 128),
    },
    256: {
        64: _blocks(256, 256, 256, 256, 256, 128, 256, 256),
        128: _blocks(256, 256, 256, 256, 256, 256, 256, 256),
    },
    512: {
        64: _blocks(512, 512, 512, 512, 512, 512, 512, 512),
        128: _blocks(512, 512, 512, 512, 512, 512, 512, 512),
    },
    1024: {
        64: _blocks(512, 512, 512, 512, 512, 512, 512, 512),
        128: _blocks(512, 1024, 512, 1024, 1024, 1024, 1024, 1024),
    },
    2048: {
        64: _blocks(512, 1024, 512, 512, 512, 512, 1024, 1024),
        128: _blocks(512, 512, 512, 512, 512, 512, 512, 512),
    },
    4096: {
        64: _blocks(1024, 1024, 512, 1024, 1024, 256, 1024, 1024),
        128: _blocks(1024, 1024, 512, 1024, 1024, 256, 1024, 1024),
    },
    8192: {
        64: _blocks(512, 512, 512, 512, 512, 512, 512, 512),
        128: _blocks(1024, 2048, 512, 1024, 1024, 1024, 512, 2048),
    },
}
#: splash tiles keys in multiples of the TPU's 128 lanes (its blocks must be multiples of it)
SPLASH_LANES = 128

#: recipe fields (section, key) of the execution options with the value an absent key means
#: (the schema's ``x-absent``: absent and spelled at that value are one computation)
DEFAULTS = {
    (section, key): schemas.absent(schemas.PACKED_SFT, section)[key]
    for section, key in (
        ("model", "attention"),
        ("model", "scan_layers"),
        ("training", "remat"),
        ("training", "loss_chunk_tokens"),
    )
}


#: the execution options a recipe naming a backend gets where it leaves them out: remat of
#: every block (only each block's input is kept for the backward pass) and the loss over
#: chunks of 1024 tokens (``[1024, vocab]`` FP32 logits at a time: 0.6 GB at a 152k
#: vocabulary). Not the GPU: recipes naming it ran before this table, and their digests stay.
ACCELERATOR_DEFAULTS = {
    "tpu": {("training", "remat"): "full", ("training", "loss_chunk_tokens"): 1024},
}


#: the shortest row at which splash attention measured faster than the XLA path on the chip,
#: at head widths 64 and 128 (``benchmarks/splash_blocks.py``, docs/tpu.md: 1.34 and 1.46
#: times at 512 tokens, slower at 256 and 128): a TPU recipe that leaves ``model.attention``
#: out computes with splash from this row length up (:func:`tpu_default_attention`)
SPLASH_FASTER_FROM = 512


def tpu_default_attention(recipe: dict) -> str:
    """``model.attention`` for a TPU recipe that leaves it out: ``pallas`` (splash) where
    splash can run the recipe (BF16 compute, whole lanes) and measured faster than the XLA
    path (rows of :data:`SPLASH_FASTER_FROM` tokens or more), else ``xla``."""
    seq_len = recipe["training"].get("seq_len", 0)
    splash_runs = (
        pallas_seq_len_problem(seq_len, "tpu") is None
        and splash_fp32_problem(recipe["model"].get("compute_dtype", "bfloat16"), "tpu") is None
    )
    return "pallas" if splash_runs and seq_len >= SPLASH_FASTER_FROM else "xla"


def defaults_for(backend: str) -> dict:
    """``{(section, key): value}`` of the execution options on ``backend`` (a recipe's
    ``runtime.backend``) where a recipe leaves them out."""
    return {**DEFAULTS, **ACCELERATOR_DEFAULTS.get(backend, {})}


@dataclass(frozen=True)
class Execution:
    """Execution options of a model (hashable: part of a static jit argument)."""

    attention: str = DEFAULTS[("model", "attention")]
    scan_layers: bool = DEFAULTS[("model", "scan_layers")]
    remat: str = DEFAULTS[("training", "remat")]
    loss_chunk_tokens: int = DEFAULTS[("training", "loss_chunk_tokens")]  # 0: whole batch
    #: the backend the recipe names (``runtime.backend``): which fused kernel ``pallas`` is
    backend: str = "any"
    #: a quantized base's product, forced (a benchmark's comparison; no recipe sets it): one of
    #: :data:`QUANTIZED_KERNEL_KINDS`; None: the backend's (:func:`quantized_kernel`)
    quantized_kernel: str | None = None

    def __post_init__(self):
        errors = []
        if self.backend not in BACKENDS:
            errors.append(f"runtime.backend: expected one of {BACKENDS}, got {self.backend!r}")
        if self.attention not in ATTENTION_KINDS:
            errors.append(
                f"model.attention: expected one of {ATTENTION_KINDS}, got {self.attention!r}"
            )
        if not isinstance(self.scan_layers, bool):
            errors.append(f"model.scan_layers: expected true or false, got {self.scan_layers!r}")
        if self.remat not in REMAT_POLICIES:
            errors.append(f"training.remat: expected one of {REMAT_POLICIES}, got {self.remat!r}")
        chunk = self.loss_chunk_tokens
        if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 0:
            errors.append(f"training.loss_chunk_tokens: expected an integer >= 0, got {chunk!r}")
        if self.quantized_kernel not in (None, *QUANTIZED_KERNEL_KINDS):
            errors.append(
                f"quantized kernel: expected one of {QUANTIZED_KERNEL_KINDS}, "
                f"got {self.quantized_kernel!r}"
            )
        if errors:
            raise ValueError("; ".join(errors))

    @classmethod
    def from_recipe(cls, recipe: dict) -> Execution:
        """The options a checked recipe selects (absent keys: the defaults)."""
        values = {
            key: recipe[section].get(key, default) for (section, key), default in DEFAULTS.items()
        }
        return cls(**values, backend=recipe.get("runtime", {}).get("backend", "any"))


def with_recipe_options(cfg, recipe: dict):
    """``cfg`` (a model config) computing as the recipe's execution options say."""
    import dataclasses

    return dataclasses.replace(cfg, execution=Execution.from_recipe(recipe))


def fused_kernel(backend: str) -> str:
    """The fused kernel ``model.attention: pallas`` runs on ``backend`` (a recipe's
    ``runtime.backend``): ``splash`` (splash attention, a TPU kernel) on a TPU; ``mha`` (the
    GPU flash-attention kernel: native on a GPU, Pallas's interpreter on CPU) elsewhere."""
    return "splash" if backend == "tpu" else "mha"


#: the experts' grouped product by a recipe's ``runtime.backend`` (absent: ``tiles``): on a
#: TPU ``ragged_dot`` (``jax.lax.ragged_dot``, XLA's grouped matrix product there) until the
#: chip measures megablox's ``gmm`` faster (``benchmarks/moe_chip.py``); ``gmm`` is BF16 only
GROUPED_KERNELS = {"tpu": "ragged_dot"}


def grouped_kernel(backend: str) -> str:
    """The experts' grouped product on ``backend`` (a recipe's ``runtime.backend``), by
    :data:`GROUPED_KERNELS`: ``tiles`` (:mod:`minifield.models.layers.grouped`'s loop over
    tiles) where it names none, as on CPU, where the pinned JAX lowers ``ragged_dot`` to every
    group's matrix times every row; otherwise a kernel of
    :mod:`minifield.models.layers.tpu_grouped`."""
    return GROUPED_KERNELS.get(backend, "tiles")


#: a quantized base's product (:mod:`minifield.models.layers.tpu_quantized`): ``xla``
#: (``quantize.dequantize`` fused by XLA into the product's operand) or ``pallas`` (the TPU
#: kernel that reads the codes and scales)
QUANTIZED_KERNEL_KINDS = ("xla", "pallas")
#: the quantized product by a recipe's ``runtime.backend`` (absent: ``xla``): on a TPU ``xla``
#: until the chip measures ``pallas`` faster (``benchmarks/qlora_step.py --quantized-kernel``,
#: docs/quantized-base.md); a backend named ``pallas`` here puts the kernel's name in its
#: quantized recipes' computation digests (``strategies.base.computation_fields``)
QUANTIZED_KERNELS = {"tpu": "xla"}


def quantized_kernel(backend: str, compute_dtype: str) -> str:
    """A quantized base's product on ``backend`` (a recipe's ``runtime.backend``) computing in
    ``compute_dtype``: :data:`QUANTIZED_KERNELS`' (absent: ``xla``), and ``xla`` for float32,
    which the kernel does not compute (its products ask for no precision)."""
    if compute_dtype == "float32":
        return "xla"
    return QUANTIZED_KERNELS.get(backend, "xla")


def splash_table_blocks(seq_len: int, head_dim: int | None) -> dict:
    """:data:`SPLASH_BLOCKS`'s sizes for rows of ``seq_len`` tokens of heads ``head_dim``
    wide: the entry of that head width at the longest measured row length not above the row
    (a block measured at 2048 tokens divides 4096's rows as well), or splash's defaults
    where there is none (another head width, a shorter row)."""
    measured = [T for T, widths in SPLASH_BLOCKS.items() if T <= seq_len and head_dim in widths]
    if not measured:
        return dict(SPLASH_DEFAULT_BLOCKS)
    return dict(SPLASH_BLOCKS[max(measured)][head_dim])


def splash_table_digest() -> str:
    """The first 16 hex digits of the sha256 of :data:`SPLASH_BLOCKS` and its defaults
    (canonical JSON): what a TPU recipe with splash attention records
    (``model.splash_table``), so its computation digest changes with the table."""
    import hashlib
    import json

    table = {str(T): {str(K): sizes for K, sizes in w.items()} for T, w in SPLASH_BLOCKS.items()}
    text = json.dumps(
        {"default": SPLASH_DEFAULT_BLOCKS, "measured": table}, sort_keys=True, separators=(",", ":")
    )
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def splash_blocks(seq_len: int, blocks: dict | None = None, head_dim: int | None = None) -> dict:
    """Splash's block sizes for rows of ``seq_len`` tokens (a multiple of
    :data:`SPLASH_LANES`) of heads ``head_dim`` wide: the table's
    (:func:`splash_table_blocks`), each of ``blocks`` overriding by field name, each lowered
    to the largest multiple of the lanes that divides the row (a compute block: its block)."""
    sizes = {**splash_table_blocks(seq_len, head_dim), **(blocks or {})}

    def fit(size: int, whole: int) -> int:
        best = SPLASH_LANES
        for block in range(SPLASH_LANES, min(size, whole) + 1, SPLASH_LANES):
            if whole % block == 0:
                best = block
        return best

    fitted = {name: fit(size, seq_len) for name, size in sizes.items()}
    for compute, whole in (
        ("block_kv_compute", "block_kv"),
        ("block_kv_dkv_compute", "block_kv_dkv"),
    ):
        fitted[compute] = fit(sizes[compute], fitted[whole])
    return fitted


def attention_kernel(execution: Execution, seq_len: int, head_dim: int) -> dict:
    """What a model computing with ``execution`` runs its attention with, for the run's
    ``compiled`` event: the kernel (``xla``, ``splash``, ``mha``) and its block sizes."""
    if execution.attention != "pallas":
        return {"kernel": "xla"}
    kernel = fused_kernel(execution.backend)
    if kernel == "splash":
        return {"kernel": kernel, "blocks": splash_blocks(seq_len, head_dim=head_dim)}
    blocks = {"forward": min(PALLAS_FORWARD_BLOCK, seq_len)}
    blocks["backward"] = min(PALLAS_BACKWARD_BLOCK, seq_len)
    return {"kernel": kernel, "blocks": blocks}


def pallas_seq_len_problem(seq_len: int, backend: str = "any") -> str | None:
    """Why the fused kernel on ``backend`` cannot run rows of ``seq_len`` tokens (None: it
    can).

    The GPU kernel tiles a row into blocks of ``min(block, seq_len)`` tokens and needs whole
    blocks, forward and backward; splash attention needs whole lanes (:func:`splash_blocks`
    fits its blocks to any such row)."""
    if fused_kernel(backend) == "splash":
        if seq_len % SPLASH_LANES:
            return (
                "model.attention pallas with runtime.backend tpu (splash attention) tiles a row "
                f"into blocks of {SPLASH_LANES} tokens: training.seq_len must be a multiple of "
                f"{SPLASH_LANES} (got {seq_len})"
            )
        return None
    for block in (PALLAS_FORWARD_BLOCK, PALLAS_BACKWARD_BLOCK):
        if seq_len % min(block, seq_len):
            return (
                f"model.attention pallas tiles a row into blocks of {block} tokens: "
                f"training.seq_len must be at most {PALLAS_BACKWARD_BLOCK}, a multiple of "
                f"{PALLAS_BACKWARD_BLOCK} up to {PALLAS_FORWARD_BLOCK}, or a multiple of "
                f"{PALLAS_FORWARD_BLOCK} (got {seq_len})"
            )
    return None


def splash_fp32_problem(compute_dtype: str, backend: str) -> str | None:
    """Why ``model.attention: pallas`` cannot compute with ``compute_dtype`` on ``backend``
    (None: it can): splash's products ask for no precision, so on a TPU an FP32 product is
    the chip's one BF16 pass, and FP32 compute would not be FP32 (as megablox's ``gmm``,
    :mod:`.layers.tpu_grouped`)."""
    if fused_kernel(backend) == "splash" and compute_dtype == "float32":
        return (
            "model.attention pallas with runtime.backend tpu (splash attention) does not "
            "compute model.compute_dtype float32: its kernel's products ask for no precision, "
            "so on a TPU they are one BF16 pass; use model.attention xla (the XLA path) for "
            "float32, or compute_dtype bfloat16"
        )
    return None


def splash_table_problems(recipe: dict, backend: str) -> list[dict]:
    """Fill in ``model.splash_table`` (:func:`splash_table_digest`) where the recipe runs
    splash attention: its block sizes come from :data:`SPLASH_BLOCKS`, and change what it
    computes (the online softmax's order of sums), so the table enters its digest as the
    memory defaults do; a recipe that computes otherwise must not name a table. Returns
    errors: a table named where splash does not run, or one this code does not have."""
    model = recipe["model"]
    splash = model.get("attention") == "pallas" and fused_kernel(backend) == "splash"
    if not splash:
        if "splash_table" in model:
            return [
                {
                    "path": "/model/splash_table",
                    "message": "model.splash_table belongs to a recipe with model.attention "
                    "pallas and runtime.backend tpu (splash attention) only",
                }
            ]
        return []
    ours = splash_table_digest()
    if model.setdefault("splash_table", ours) != ours:
        return [
            {
                "path": "/model/splash_table",
                "message": f"model.splash_table {model['splash_table']!r} is not this code's "
                f"table of splash's block sizes ({ours}): the recipe was checked with another "
                "table, so this code would compute otherwise",
            }
        ]
    return []


def normalize_recipe(recipe: dict) -> list[dict]:
    """Fill in the backend's memory options a recipe leaves out (:data:`ACCELERATOR_DEFAULTS`)
    and on a TPU its attention kernel (:func:`tpu_default_attention`), then remove execution options equal to their defaults (digest stability); returns
    errors."""
    backend = recipe.get("runtime", {}).get("backend", "any")
    for (section, key), value in ACCELERATOR_DEFAULTS.get(backend, {}).items():
        recipe[section].setdefault(key, value)
    if backend == "tpu" and "attention" not in recipe["model"]:
        recipe["model"]["attention"] = tpu_default_attention(recipe)
    for (section, key), default in DEFAULTS.items():
        if key in recipe[section] and recipe[section][key] == default:
            del recipe[section][key]
    errors = splash_table_problems(recipe, backend)
    if recipe["model"].get("attention") == "pallas":
        problem = pallas_seq_len_problem(recipe["training"]["seq_len"], backend)
        if problem:
            errors.append({"path": "/model/attention", "message": problem})
        # the schema's default is BF16 (absent only where a strategy's schema has none)
        problem = splash_fp32_problem(recipe["model"].get("compute_dtype", "bfloat16"), backend)
        if problem:
            errors.append({"path": "/model/attention", "message": problem})
        window = recipe["model"].get("sliding_window")
        binds = window is not None and window < recipe["training"]["seq_len"]
        if binds and fused_kernel(backend) == "mha":
            errors.append(
                {
                    "path": "/model/sliding_window",
                    "message": "the fused kernel (model.attention pallas) has no sliding window "
                    f"off a TPU; {window} < training.seq_len {recipe['training']['seq_len']}",
                }
            )
    return errors
