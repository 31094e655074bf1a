"""Compile time of the packed-SFT update against depth, with the layer loop and with ``lax.scan``.

For each depth (default 4, 16, 32 layers) and each layer stack (``model.scan_layers`` false,
then true) the complete update (forward, backward, AdamW) is traced, lowered and compiled
for abstract inputs, as the worker's ``compile()`` does, and the wall time is taken. A warm-up
compile of a 1-layer model comes first so one-time JAX set-up is not charged to the first
figure. Prints the seconds (wall, and CPU time of this process: less disturbed by other
work on a shared machine) and the ratios against the 4-layer figure of the same stack.
``--part grad`` compiles only the loss and its gradient (no optimizer update), which shows how
much of the depth-dependence is the model and how much the per-layer optimizer update.

    uv run python benchmarks/compile_depth.py [--layers 4 16 32] [--d-model 256] [--seq-len 256]
        [--batch 4] [--architecture gpt|llama] [--remat none|full|dots_saveable] [--part step|grad]
        [--stacks loop scan]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time

import jax

from minifield.data.packing import Rows
from minifield.models import model
from minifield.models.execution import Execution
from minifield.models.llama import LlamaConfig
from minifield.training import optimizer, train_step

TRAINING = {**optimizer.defaults(), "warmup_steps": 1}


def config(args, layers: int, scan: bool):
    size = dict(vocab_size=260, d_model=args.d_model, n_layers=layers, n_heads=args.d_model // 64)
    size.update(d_ff=4 * args.d_model, max_len=args.seq_len)
    if args.architecture == "llama":
        cfg = LlamaConfig(n_kv_heads=max(1, size["n_heads"] // 2), **size)
    else:
        cfg = model.ModelConfig(positions="rotary", **size)
    return dataclasses.replace(cfg, execution=Execution(scan_layers=scan, remat=args.remat))


def compile_seconds(cfg, batch: int, seq_len: int, part: str = "step") -> tuple[float, float]:
    """Wall and CPU seconds to trace, lower and compile the update (or ``grad``)."""
    tx = optimizer.make_optimizer(TRAINING, 100)
    step = train_step.make_train_step(cfg, tx)
    state = jax.eval_shape(lambda: train_step.init_train_state(cfg, tx, 0))
    if part == "grad":
        state = state["params"]

        def step(params, batch):
            return jax.grad(lambda p: model.loss_fn(p, cfg, batch)[0])(params)

    rows = jax.ShapeDtypeStruct((batch, seq_len), jax.numpy.int32)
    mask = jax.ShapeDtypeStruct((batch, seq_len), jax.numpy.float32)
    abstract_batch = Rows(tokens=rows, segments=rows, positions=rows, loss_mask=mask)
    start, cpu_start = time.perf_counter(), time.process_time()
    jax.jit(step, donate_argnums=(0,)).lower(state, abstract_batch).compile()
    return time.perf_counter() - start, time.process_time() - cpu_start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[4, 16, 32])
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--architecture", choices=["gpt", "llama"], default="gpt")
    parser.add_argument("--remat", choices=["none", "full", "dots_saveable"], default="none")
    parser.add_argument("--part", choices=["step", "grad"], default="step")
    parser.add_argument("--stacks", nargs="+", choices=["loop", "scan"], default=["loop", "scan"])
    args = parser.parse_args()
    compile_seconds(config(args, 1, False), args.batch, args.seq_len, args.part)  # warm-up
    results, cpu = {}, {}
    for stack in args.stacks:
        scan = stack == "scan"
        for layers in args.layers:
            seconds, cpu_seconds = compile_seconds(
                config(args, layers, scan), args.batch, args.seq_len, args.part
            )
            results[f"{stack}_{layers}"] = round(seconds, 2)
            cpu[f"{stack}_{layers}"] = round(cpu_seconds, 2)
            print(
                f"{stack:4s} {layers:3d} layers: {seconds:7.2f} s (CPU {cpu_seconds:7.2f} s)",
                flush=True,
            )
    first, last = args.layers[0], args.layers[-1]
    ratios = {}
    for stack in args.stacks:
        for name, figures in (("", results), ("cpu_", cpu)):
            ratios[f"{name}{stack}_{last}_over_{first}"] = round(
                figures[f"{stack}_{last}"] / figures[f"{stack}_{first}"], 2
            )
    if len(args.stacks) == 2:
        ratios[f"loop_over_scan_at_{last}"] = round(
            results[f"loop_{last}"] / results[f"scan_{last}"], 2
        )
    load = round(os.getloadavg()[0], 2)
    report = {"settings": vars(args), "seconds": results, "cpu_seconds": cpu, "ratios": ratios}
    print(json.dumps({**report, "loadavg_at_end": load}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
