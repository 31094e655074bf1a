"""How the model computes, as opposed to what it computes: attention kernel, layer loop,
rematerialisation and loss chunking.

Four recipe fields select it (see docs/model.md, "Execution options")::

    model.attention: xla | pallas        # absent: xla
    model.scan_layers: true | false      # absent: false
    training.remat: none | full | dots_saveable | save_attention | offload_attention | auto
                                                  # absent: none
    training.loss_chunk_tokens: N        # absent or 0: the whole batch at once

Every option computes the same mathematics as the default; the floating-point bits may differ
(another kernel, another fusion, another summation order), so a value other than the default is
part of the computation digest. A value equal to the default is removed from the recipe when it
is checked (:func:`normalize_recipe`), so recipes written before these fields, and recipes that
spell the defaults out, keep their computation digest.

A recipe that names the TPU (``runtime.backend: tpu``) gets the memory options of
:data:`ACCELERATOR_DEFAULTS` where it leaves them out: on a 16 GB chip a useful step does not
fit without them. A recipe whose step's memory is estimated (packed-sft of the Llama
architecture, :mod:`.device_memory`) gets ``remat: auto`` instead of ``full``: the policy and micro-batches
chosen from the model's shape when the program is built (:func:`.device_memory.plan`), the
rule's digest written beside it (``training.remat_rule``). Its attention too: splash (``pallas``) where it measured faster than the XLA
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
from .splash_table import SPLASH_LANES, splash_blocks, splash_table_digest

ATTENTION_KINDS = ("xla", "pallas")
REMAT_POLICIES = ("none", "full", "dots_saveable", "save_attention", "offload_attention")
#: ``training.remat`` that names no policy: :func:`.device_memory.plan` chooses one and the
#: micro-batches from the model's shape (packed-sft only, whose step's memory is estimated)
AUTO_REMAT = "auto"

#: the backends a recipe can name (``runtime.backend``)
BACKENDS = ("cpu", "gpu", "tpu", "any")

#: block sizes of the GPU fused (Pallas) attention kernel: forward query/key blocks, and the
#: backward pass's blocks; each is capped at the row length, which it must divide
PALLAS_FORWARD_BLOCK = 128
PALLAS_BACKWARD_BLOCK = 32

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
#: what a strategy whose step's memory is estimated gets instead (packed-sft): the policy and
#: micro-batches that fit, chosen by :func:`.device_memory.plan` (docs/tpu.md: not recomputing
#: the forward pass measured faster on the chip at every split that fit)
ESTIMATED_STEP_DEFAULTS = {"tpu": {("training", "remat"): AUTO_REMAT}}


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


def defaults_for(backend: str, estimated: bool = False) -> dict:
    """``{(section, key): value}`` of the execution options on ``backend`` (a recipe's
    ``runtime.backend``) where a recipe leaves them out; ``estimated``: for a strategy whose
    step memory is estimated (packed-sft's)."""
    found = {**DEFAULTS, **ACCELERATOR_DEFAULTS.get(backend, {})}
    return {**found, **(ESTIMATED_STEP_DEFAULTS.get(backend, {}) if estimated else {})}


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
    """``cfg`` (a model config) computing as the recipe's execution options say (``remat:
    auto``: the policy :func:`.device_memory.plan` chooses for ``cfg``)."""
    import dataclasses

    from . import device_memory

    chosen = device_memory.plan(cfg, recipe).remat
    resolved = {**recipe, "training": {**recipe["training"], "remat": chosen}}
    return dataclasses.replace(cfg, execution=Execution.from_recipe(resolved))


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
    return _filled_digest(
        model, "/model/splash_table", splash_table_digest(), "table of splash's block sizes"
    )


def _filled_digest(section: dict, path: str, ours: str, what: str) -> list[dict]:
    """Fill in the code's digest ``ours`` at ``path`` (in ``section``) where the recipe leaves
    it out; an error where it spells another (it was checked with other code)."""
    key = path.rsplit("/", 1)[-1]
    if section.setdefault(key, ours) == ours:
        return []
    field = path.strip("/").replace("/", ".")
    return [
        {
            "path": path,
            "message": f"{field} {section[key]!r} is not this code's {what} ({ours}): the "
            "recipe was checked with another, so this code could compute otherwise",
        }
    ]


def remat_rule_problems(recipe: dict, estimated: bool) -> list[dict]:
    """Fill in ``training.remat_rule`` (:func:`.device_memory.auto_rule_digest`) where the
    recipe's remat is ``auto``: what the rule chooses changes what it computes (the policy's
    fusions, the micro-batches' sums), so the rule enters the digest as splash's table does.
    Returns errors: ``auto`` for a strategy whose step is not estimated (``estimated``
    false), a rule named without ``auto``, or one this code does not have."""
    from . import device_memory

    training = recipe["training"]
    if training.get("remat") != AUTO_REMAT:
        if "remat_rule" in training:
            return [
                {
                    "path": "/training/remat_rule",
                    "message": "training.remat_rule belongs to a recipe with training.remat "
                    "auto only",
                }
            ]
        return []
    if not estimated:
        return [
            {
                "path": "/training/remat",
                "message": "training.remat auto chooses from the estimated memory of packed-"
                "sft's step of a model.architecture llama model, which this recipe's step is "
                "not: name a policy (full, dots_saveable, save_attention, offload_attention or "
                "none)",
            }
        ]
    ours = device_memory.auto_rule_digest()
    return _filled_digest(training, "/training/remat_rule", ours, "rule for training.remat auto")


def normalize_recipe(recipe: dict, estimated: bool = False) -> list[dict]:
    """Fill in the backend's memory options a recipe leaves out (:data:`ACCELERATOR_DEFAULTS`;
    :data:`ESTIMATED_STEP_DEFAULTS` where the strategy's step memory is ``estimated``) and on
    a TPU its attention kernel (:func:`tpu_default_attention`), then remove execution options
    equal to their defaults (digest stability); returns errors."""
    backend = recipe.get("runtime", {}).get("backend", "any")
    filled = dict(ACCELERATOR_DEFAULTS.get(backend, {}))
    if estimated:
        filled.update(ESTIMATED_STEP_DEFAULTS.get(backend, {}))
    for (section, key), value in filled.items():
        recipe[section].setdefault(key, value)
    if backend == "tpu" and "attention" not in recipe["model"]:
        recipe["model"]["attention"] = tpu_default_attention(recipe)
    for (section, key), default in DEFAULTS.items():
        if key in recipe[section] and recipe[section][key] == default:
            del recipe[section][key]
    errors = splash_table_problems(recipe, backend)
    errors += remat_rule_problems(recipe, estimated)
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
