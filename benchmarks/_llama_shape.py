"""The Llama model shape benchmarks take as arguments, and the config it describes
(``lora_step.py``, ``preference_step.py``, ``generation_cache.py``)."""

from __future__ import annotations

import argparse

from minifield.models import llama


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """``--d-model --layers --heads --kv-heads --vocab --dtype``."""
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))


def add_step_arguments(parser: argparse.ArgumentParser) -> None:
    """The model's, and the rows and timing of a train-step benchmark: ``--batch --seq
    --steps --rounds``."""
    add_model_arguments(parser)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--steps", type=int, default=5, help="timed calls per round")
    parser.add_argument("--rounds", type=int, default=3)


def config(args, max_len: int) -> llama.LlamaConfig:
    """The Llama config of the arguments (MLP width 4 × d_model)."""
    return llama.LlamaConfig(
        vocab_size=args.vocab,
        d_model=args.d_model,
        n_layers=args.layers,
        n_heads=args.heads,
        n_kv_heads=args.kv_heads,
        d_ff=4 * args.d_model,
        max_len=max_len,
        compute_dtype=args.dtype,
    )
