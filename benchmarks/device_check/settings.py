"""What every part of the device check shares: its sections, their time limits, the models
and the settings a section's process derives from the command line."""

from __future__ import annotations

from pathlib import Path

PACKAGE = Path(__file__).resolve().parent  # what ``python benchmarks/device_check`` runs
REPO = PACKAGE.parent.parent

#: the JSON's format (``minifield-gpu-check/1`` before the check was named for any device)
FORMAT = "minifield-device-check/2"
SECTIONS = (
    "device", "step_125m", "step_350m", "recovery", "checkpoint", "shapes", "determinism_cost",
)  # fmt: skip
#: each section's own time limit (seconds, compilation included); the overall budget caps it.
#: On the chip every process that opens it waits ~10 s for it, and one chip call runs at most
#: 9.5 minutes: ``--sections device recovery shapes checkpoint --proof-mode both`` is 60 +
#: 235 + 160 + 80 = 535 s of limits, inside :data:`BUDGET_S` with the parent's start-up. A
#: section cut short costs differently: the device section's failure skips every other, a
#: proof cut short proves nothing, the shapes section stops with the models it reached.
SECTION_LIMIT_S = {
    "device": 60,  # chip open ~10 s, the 8192 matmul probe, 1 GiB of bandwidth: ~30 s
    "step_125m": 150,
    "step_350m": 180,
    # the proof's workers each start, open the chip (~10-15 s), compile and train: 3
    # workers in crash mode, 5 in both (~35 s each); the chip's one run of the proof in both
    # modes (15e5d9e, docs/tpu.md) ran 193 s before it stopped, past the old 180 s
    "recovery": 235,
    "checkpoint": 80,  # a 1.5 GB state: chip open, compile, 2 rounds of ~13 s
    # about 17 compiles of 5-15 s each for all three models (section_shapes); it stops in
    # time with what it has, and the rest can be run alone (docs/tpu.md)
    "shapes": 160,
    "determinism_cost": 90,
}
#: the whole check by default: the chip's one call (above); all seven sections need more
#: (each past the budget is recorded ``skipped``): give ``--budget-s`` on a GPU host
BUDGET_S = 540.0
TINY_BUDGET_S = 300.0
NOT_APPLICABLE = "not_applicable"  # a section this backend has no use for (not a failure)
#: a section is not started with less time than this left in the budget
MIN_SECTION_S = 20.0

#: Llama-style models: name -> (d_model, layers, heads, kv heads, d_ff, vocabulary)
MODELS = {
    "125m": (768, 12, 12, 12, 1792, 32000),
    "350m": (1024, 24, 16, 16, 2560, 32000),
}
TINY_MODELS = {
    "125m": (32, 2, 2, 2, 64, 128),
    "350m": (64, 2, 4, 2, 96, 160),
}
SEQ_LEN, TINY_SEQ_LEN = 2048, 64
#: rows per step: 32k tokens at 125M, 16k at 350M (activations of 24 layers without remat)
BATCH = {"125m": 16, "350m": 8}
TINY_BATCH = {"125m": 2, "350m": 2}
#: with --jobs: the order sections start in (longest first on a CPU)
JOBS_ORDER = (
    "device", "recovery", "step_350m", "shapes", "step_125m", "checkpoint", "determinism_cost",
)  # fmt: skip
MAX_STEPS = 1000  # the learning-rate schedule's length (the check runs far fewer)

#: the recovery proof's recipe: the demo's pinned data, a small Llama model
RECOVERY_MODEL = {"d_model": 256, "n_layers": 4, "n_heads": 4, "d_ff": 512}
TINY_RECOVERY_MODEL = {"d_model": 32, "n_layers": 1, "n_heads": 2, "d_ff": 64}
RECOVERY_SEQ_LEN = 128


def model_shape(args, size: str):
    from minimal import llama as minimal

    table = TINY_MODELS if args.tiny else MODELS
    return minimal.Shape(*table[size])


def seq_len(args) -> int:
    return TINY_SEQ_LEN if args.tiny else SEQ_LEN


def batch_rows(args, size: str) -> int:
    if args.batch:
        return args.batch
    return (TINY_BATCH if args.tiny else BATCH)[size]


def execution(args, remat: str | None = None):
    """The sections' execution options; ``remat`` (a step section's plan) over ``--remat``,
    whose ``auto`` the other sections (shapes, checkpoint) take as its fallback, ``full``:
    they search or hold one state, with no split to choose."""
    from minifield.models.device_memory import AUTO_FALLBACK
    from minifield.models.execution import AUTO_REMAT, Execution

    remat = remat or args.remat
    return Execution(
        attention=args.attention,
        scan_layers=args.scan_layers,
        remat=AUTO_FALLBACK if remat == AUTO_REMAT else remat,
        loss_chunk_tokens=args.loss_chunk_tokens,
        backend=expected_backend(args),  # which fused kernel ``pallas`` is
    )


def default_attention(backend: str, tiny: bool) -> str:
    """The step sections' kernel where none is asked for: the GPU's fused kernel; on a TPU what
    a recipe of :data:`SEQ_LEN`-token rows gets (``execution.tpu_default_attention``); the XLA
    path with ``tiny`` (Pallas's CPU interpreter is slow)."""
    from minifield.models.execution import tpu_default_attention

    if tiny:
        return "xla"
    if backend == "tpu":
        return tpu_default_attention({"training": {"seq_len": SEQ_LEN}, "model": {}})
    return "pallas" if backend == "gpu" else "xla"


def memory_defaults(backend: str) -> tuple[str, int]:
    """``(remat, loss_chunk_tokens)`` a packed-sft recipe naming ``backend`` gets where it
    leaves them out (the TPU's: ``remat: auto``, chunks of 1024;
    ``models.execution.ESTIMATED_STEP_DEFAULTS``)."""
    from minifield.models.execution import defaults_for

    found = defaults_for(backend, estimated=True)
    return found[("training", "remat")], found[("training", "loss_chunk_tokens")]


def step_plan(args, size: str):
    """The step section's remat policy and micro-batches (``models.device_memory.Plan``): as
    asked, or with ``--remat auto`` what a packed-sft recipe of the same model, rows and
    options gets (``--grad-accum-steps`` its fewest micro-batches)."""
    from minifield.models import device_memory
    from minifield.models.execution import Execution

    recipe = {
        "model": {"attention": args.attention},
        "training": {
            "batch_size": batch_rows(args, size), "seq_len": seq_len(args),
            "remat": args.remat, "grad_accum_steps": args.grad_accum_steps,
            "loss_chunk_tokens": args.loss_chunk_tokens,
        },
    }  # fmt: skip
    cfg = llama_config(model_shape(args, size), seq_len(args), Execution())
    return device_memory.plan(cfg, recipe)


def llama_config(shape, seq: int, exec_options):
    from minifield.models.llama import LlamaConfig

    return LlamaConfig(
        vocab_size=shape.vocab_size,
        d_model=shape.d_model,
        n_layers=shape.n_layers,
        n_heads=shape.n_heads,
        n_kv_heads=shape.n_kv_heads,
        d_ff=shape.d_ff,
        max_len=seq,
        rope_theta=shape.rope_theta,
        norm_eps=shape.norm_eps,
        compute_dtype="bfloat16",
        execution=exec_options,
    )


def expected_backend(args) -> str:
    return args.backend or ("cpu" if args.tiny else "gpu")


def recovery_recipe(args) -> dict:
    """The demo recipe's pinned data and settings with a small Llama model computing as the
    step sections do; long enough (``max_steps``) that the proof's truncated runs end by the
    step limit, without the final evaluation."""
    import yaml

    recipe = yaml.safe_load((REPO / "config/recipes/sft-demo.yaml").read_text())
    recipe["job_id"] = "device-check-recovery"
    tpu_default = expected_backend(args) == "tpu" and not args.attention_asked
    recipe["model"] = {
        "architecture": "llama",
        **(TINY_RECOVERY_MODEL if args.tiny else RECOVERY_MODEL),
        "compute_dtype": "bfloat16",
        "tokenizer": recipe["model"]["tokenizer"],
        # on a TPU an unasked kernel is the recipe's own default at its rows (the XLA path at
        # 128 tokens), as a user's recipe gets it
        **({} if tpu_default else {"attention": args.attention}),
        "scan_layers": args.scan_layers,
    }
    recipe["training"].update(
        seq_len=TINY_SEQ_LEN if args.tiny else RECOVERY_SEQ_LEN,
        batch_size=4 if args.tiny else 16,
        warmup_steps=2,
        remat=args.remat,
        loss_chunk_tokens=args.loss_chunk_tokens,
    )
    recipe["limits"] = {"max_steps": 1000}
    recipe["checkpoint"] = {"every_steps": 2 if args.tiny else 3, "keep": 2}
    recipe["evaluation"] = {"eval_every": 0, "max_generate_examples": 1, "batch_size": 4}
    recipe["runtime"] = {"backend": expected_backend(args)}
    return recipe
