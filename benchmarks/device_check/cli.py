"""The device check's command line: the parent's options, and what it passes to each
section's process."""

from __future__ import annotations

import argparse
import sys

import device_check
from device_check.settings import (
    BATCH,
    BUDGET_S,
    SECTIONS,
    TINY_BATCH,
    default_attention,
    expected_backend,
    memory_defaults,
)
from minifield.models.execution import AUTO_REMAT, REMAT_POLICIES


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        prog="benchmarks/device_check", description=device_check.__doc__.split("\n")[0]
    )
    parser.add_argument("--out", default="device_check.json", help="the JSON written (rewritten as "
                        "sections finish)")  # fmt: skip
    parser.add_argument("--tiny", action="store_true", help="tiny models: the CPU run of the tests")
    parser.add_argument("--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS))
    parser.add_argument("--budget-s", type=float, help=f"overall limit (default {BUDGET_S:.0f})")
    parser.add_argument("--work-dir", help="runs, checkpoints (default: a new work/device-check-*)")
    parser.add_argument("--keep-work", action="store_true", help="keep the default work dir")
    parser.add_argument("--backend", choices=("cpu", "gpu", "tpu"), help="the backend the device "
                        "check requires (default gpu; cpu with --tiny)")  # fmt: skip
    parser.add_argument("--attention", choices=("pallas", "xla"), help="the attention kernel of "
                        "the step, shapes and checkpoint sections (default: pallas, the fused "
                        "kernel, on a GPU; on a TPU what a recipe of 2048-token rows gets, "
                        "splash; xla with --tiny: Pallas's CPU interpreter is slow)")  # fmt: skip
    parser.add_argument("--scan-layers", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--remat", choices=(*REMAT_POLICIES, AUTO_REMAT), help="training.remat "
                        "of both loops; default: what a packed-sft recipe naming the backend "
                        "gets (auto on a TPU: the policy and micro-batches chosen per model, "
                        "full for the shapes and checkpoint sections; else none)")  # fmt: skip
    parser.add_argument("--loss-chunk-tokens", type=int, help="the loss over chunks of this "
                        "many tokens; default: what a recipe naming the backend gets (1024 on "
                        "a TPU, else 0: all at once)")  # fmt: skip
    parser.add_argument("--batch", type=int, help="rows per step for both sizes (default: "
                        f"{BATCH}; tiny {TINY_BATCH})")  # fmt: skip
    parser.add_argument("--grad-accum-steps", type=int, default=1, help="the step sections' "
                        "updates over this many micro-batches of their rows, both loops "
                        "(training.grad_accum_steps; it must divide the rows)")  # fmt: skip
    parser.add_argument("--ours-only", action="store_true", help="the step sections time our "
                        "step alone, without the minimal loop (a sweep of our own settings, "
                        "--remat and --grad-accum-steps: its compile is a minute at 350M)")  # fmt: skip
    parser.add_argument("--rounds", type=int, help="timed rounds (default 5; tiny 2)")
    parser.add_argument("--steps-per-round", type=int, help="steps per round (default 10; tiny 2)")
    parser.add_argument("--checkpoint-rounds", type=int, help="commits of each kind (default 2)")
    parser.add_argument("--pooled-piece-bytes", type=int, help="the checkpoint section's "
                        "pieces.LARGE_PIECE: arrays of pieces this large are hashed on the "
                        "hashing threads (default: the code's; a comparison on a host with "
                        "more cores)")  # fmt: skip
    parser.add_argument("--jobs", type=int, default=1, help="sections run side by side after "
                        "the device section (CPU only: one GPU runs one section at a time)")  # fmt: skip
    parser.add_argument("--proof-mode", choices=("crash", "preempt", "both"), default="crash")
    parser.add_argument("--device-memory-bytes", type=int, help="the memory the shapes "
                        "section fits steps into (default: the device's own bytes_limit; "
                        "with --tiny a small made-up one, so the search is exercised)")  # fmt: skip
    parser.add_argument("--shapes-models", nargs="+", help="the shapes section's models "
                        "(default all: qwen2.5-0.5b llama-3.2-1b llama-3.2-3b)")  # fmt: skip
    parser.add_argument("--shapes-modes", nargs="+", choices=("full", "lora"),
                        help="the shapes section's modes (default both)")  # fmt: skip
    # the parent starts itself with these for each section
    parser.add_argument("--section", choices=SECTIONS, help=argparse.SUPPRESS)
    parser.add_argument("--section-out", help=argparse.SUPPRESS)
    parser.add_argument("--context", help=argparse.SUPPRESS)
    parser.add_argument("--deadline", type=float, help=argparse.SUPPRESS)
    # NAME=SECONDS: a section's own limit (the tests time one out on purpose)
    parser.add_argument("--section-limit", action="append", default=[], help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    limits = {}
    for item in args.section_limit:
        name, _, seconds = item.partition("=")
        if name not in SECTIONS or not seconds.replace(".", "", 1).isdigit():
            parser.error(f"--section-limit: expected SECTION=SECONDS with a section of "
                         f"{', '.join(SECTIONS)}, got {item!r}")  # fmt: skip
        limits[name] = float(seconds)
    args.section_limit = limits
    backend = expected_backend(args)
    # the recovery section's recipe leaves an unasked kernel to the recipe's own default
    args.attention_asked = args.attention is not None
    args.attention = args.attention or default_attention(backend, args.tiny)
    remat, chunk = memory_defaults(backend)
    args.remat = args.remat or remat
    args.loss_chunk_tokens = chunk if args.loss_chunk_tokens is None else args.loss_chunk_tokens
    if args.grad_accum_steps < 1:
        parser.error(f"--grad-accum-steps: expected an integer >= 1, got {args.grad_accum_steps}")
    args.rounds = args.rounds or (2 if args.tiny else 5)
    args.steps_per_round = args.steps_per_round or (2 if args.tiny else 10)
    args.checkpoint_rounds = args.checkpoint_rounds or (1 if args.tiny else 2)
    # what every section's process is started with (the settings, not the parent's plumbing)
    args.passthrough = [
        *(["--tiny"] if args.tiny else []),
        *(["--backend", args.backend] if args.backend else []),
        *(["--attention", args.attention] if args.attention_asked else []),
        "--scan-layers" if args.scan_layers else "--no-scan-layers",
        "--remat", args.remat,
        "--loss-chunk-tokens", str(args.loss_chunk_tokens),
        *(["--batch", str(args.batch)] if args.batch else []),
        "--grad-accum-steps", str(args.grad_accum_steps),
        *(["--ours-only"] if args.ours_only else []),
        "--rounds", str(args.rounds),
        "--steps-per-round", str(args.steps_per_round),
        "--checkpoint-rounds", str(args.checkpoint_rounds),
        *(["--pooled-piece-bytes", str(args.pooled_piece_bytes)]
          if args.pooled_piece_bytes else []),
        "--proof-mode", args.proof_mode,
        *(["--device-memory-bytes", str(args.device_memory_bytes)]
          if args.device_memory_bytes else []),
        *(["--shapes-models", *args.shapes_models] if args.shapes_models else []),
        *(["--shapes-modes", *args.shapes_modes] if args.shapes_modes else []),
    ]  # fmt: skip
    return args


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--section" not in argv:
        # the parent: only a worker opens the accelerator (parent.py), so this process keeps
        # off it before anything here could start JAX; a section's process was started with
        # the environment its section needs (``parent.child_env``)
        from minifield.supervision import accelerator

        accelerator.keep_off()
    args = parse_args(argv)
    if args.section:
        from device_check.child import run_section_child

        return run_section_child(args)
    from device_check.parent import run_parent

    return run_parent(args)
