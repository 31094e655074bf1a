"""Greedy generation of a Llama-architecture model with and without the key/value cache.

In FP32 both loops generate the same tokens (checked here: a difference is an error); in
BF16 the products are summed in another order (a single position against the whole buffer),
so near-tied argmaxes of an untrained model may flip: the agreement is printed. The uncached one runs the full forward
over the whole buffer for every new token, the cached one the prompt once and then one
position per token. Each is compiled first (one untimed call), then timed over ``--repeats``
calls in the same process; prints the seconds and the ratio uncached / cached.

    uv run python benchmarks/generation_cache.py [--d-model 256 --layers 4 --new 192]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import jax
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _llama_shape  # noqa: E402

from minifield.models import llama, model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    _llama_shape.add_model_arguments(parser)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--new", type=int, default=192)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()

    length = args.prompt + args.new
    cfg = _llama_shape.config(args, length)
    params = llama.init_params(cfg, jax.random.key(0))
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, args.vocab, args.prompt).tolist() for _ in range(args.batch)]

    def run(cache: bool) -> tuple[list[list[int]], float]:
        model.greedy_generate_batch(params, cfg, prompts, args.new, None, cache=cache)  # compile
        start = time.perf_counter()
        for _ in range(args.repeats):
            out = model.greedy_generate_batch(params, cfg, prompts, args.new, None, cache=cache)
        return out, (time.perf_counter() - start) / args.repeats

    cached, cached_s = run(True)
    plain, plain_s = run(False)
    same = cached == plain
    first = [
        next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None)
        for a, b in zip(cached, plain, strict=True)
    ]
    print(
        f"llama d{args.d_model} L{args.layers} GQA {args.heads}/{args.kv_heads} {args.dtype}, "
        f"batch {args.batch}, prompt {args.prompt} + {args.new} new tokens "
        f"(buffer {length}), {jax.device_count()} {jax.default_backend()} device(s)"
    )
    print(f"uncached: {plain_s:.3f} s/call   cached: {cached_s:.3f} s/call")
    print(f"speed-up (uncached / cached): {plain_s / cached_s:.2f}x   same tokens: {same}")
    if not same:
        print(f"first differing token per row (None: identical): {first}")
    if not same and args.dtype == "float32":
        raise SystemExit("cached and uncached generation differ")


if __name__ == "__main__":
    main()
