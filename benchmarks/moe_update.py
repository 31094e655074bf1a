"""Mixture-of-experts update: minifield's train step on a Mixtral-shaped model against minimal
JAX loops written here, and against running every expert on every token.

The model: Llama attention (d512, ``--layers`` 2, GQA 8/2 heads, rotary, untied head, vocabulary
512) with Mixtral's MLP in every layer: ``--experts`` experts of width ``--ffn`` 1024, the top
2 per token (softmax, top-k, renormalised), one packed batch of ``--rows`` x ``--seq``
(2 x 256: 512 tokens, 1,024 (token, expert) pairs), compute ``--dtype``. Each loop is one
training update (forward, backward, global-norm clipping, AdamW with the recipe schema's
defaults), ``jax.jit`` with the state donated, compiled ahead, then run once untimed:

- **minifield**: ``LlamaConfig(n_experts=…)`` + ``optimizer.make_optimizer`` +
  ``train_step.make_train_step``, as the worker runs it: experts held one matrix per expert,
  stacked inside the step, the grouped product of :mod:`minifield.models.layers.grouped`;
- **minimal ragged_dot**: the same model from the equations (``minimal.llama.logits`` with a
  mixture-of-experts MLP of ``minimal/experts.py``: FP32 router, softmax, top-k renormalised, the (token,
  expert) pairs sorted by expert, the tokens gathered, one ``jax.lax.ragged_dot`` per
  projection against the experts held stacked ``[E, in, out]``, weighted, scatter-added back),
  ``minimal.llama.make_optimizer``, plain autodiff;
- **minimal grouped**: that loop with minifield's grouped product in place of ``ragged_dot``
  (experts still held stacked): what minifield costs beyond the product itself;
- **dense**: that loop with every expert on every token, each output times the token's router
  weight for it (0 for experts outside its top 2), ``[E, N, F]`` intermediates.

Line 1 (``--experts``, 8): minifield, minimal ragged_dot, minimal grouped; line 2
(``--dense-experts``, 16): minifield and dense. Printed per loop: median seconds per update
(wall, and CPU time of the process), the ratios of the medians against minifield, the first
update's loss and gradient norm of each (they must agree: the same parameters, the same
batch), the load average before and after; and at the end each loop's loss at the first
parameters computed in FP32 (agreement within FP32 rounding: the loops compute the same
function). Rounds interleave the loops, the first one alternating.

    .venv/bin/python benchmarks/moe_update.py [--experts 8 --dense-experts 16 --rounds 3]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from minimal import llama as minimal  # noqa: E402
from minimal.experts import (  # noqa: E402
    MAX_STEPS,
    TOP_K,
    dense_mlp,
    gmm_product,
    grouped_product,
    minimal_step,
    ragged_product,
    sorted_mlp,
    stacked_mlp,
)

from minifield.models import model as project_model  # noqa: E402
from minifield.models.execution import Execution  # noqa: E402
from minifield.models.llama import LlamaConfig  # noqa: E402
from minifield.training.optimizer import make_optimizer  # noqa: E402
from minifield.training.train_step import init_train_state, make_train_step  # noqa: E402

F32 = jnp.float32
HEADS, KV_HEADS, VOCAB = 8, 2, 512


def config(args, experts: int, dtype: str) -> LlamaConfig:
    """The model; ``args.backend`` (absent: any) is the recipe's ``runtime.backend``, which
    picks minifield's grouped product (``execution.grouped_kernel``)."""
    return LlamaConfig(
        vocab_size=VOCAB, d_model=args.d_model, n_layers=args.layers, n_heads=HEADS,
        n_kv_heads=KV_HEADS, d_ff=args.ffn, max_len=args.seq, compute_dtype=dtype,
        n_experts=experts, experts_per_token=TOP_K,
        execution=Execution(backend=getattr(args, "backend", "any")),
    )  # fmt: skip


#: minifield's loops: the grouped product its TPU recipe runs (None), or the kernel it is
#: traced with instead (``ragged_tgmm``: ``tpu_grouped``'s ``tgmm`` for the experts' gradient)
OURS = {"minifield": None, "minifield ragged_tgmm": "ragged_tgmm"}


@contextlib.contextmanager
def grouped_kernel(kernel: str | None):
    """minifield traced with ``kernel`` as a TPU recipe's grouped product (None: as it is):
    what a TPU recipe would run were ``execution.GROUPED_KERNELS`` to name it."""
    from minifield.models import execution

    named = execution.GROUPED_KERNELS
    if kernel is not None:
        execution.GROUPED_KERNELS = {**named, "tpu": kernel}
    try:
        yield
    finally:
        execution.GROUPED_KERNELS = named


@contextlib.contextmanager
def megablox_tiles(tiling):
    """``tpu_grouped.GMM_TILING`` as ``tiling`` (None: as shipped) meanwhile: the tiles
    megablox's ``gmm`` and ``tgmm`` run at when traced."""
    from minifield.models.layers import tpu_grouped

    shipped = tpu_grouped.GMM_TILING
    tpu_grouped.GMM_TILING = tuple(tiling) if tiling else shipped
    try:
        yield
    finally:
        tpu_grouped.GMM_TILING = shipped


def loops(args, experts: int, names: tuple, batch: dict) -> dict:
    """``{name: {"run": run(), "first": (loss, grad_norm), "fp32": loss}}``, each compiled and
    run once (its first update's loss and gradient norm kept)."""
    cfg = config(args, experts, args.dtype)
    cfg32 = config(args, experts, "float32")
    opt = make_optimizer({}, MAX_STEPS)
    state = init_train_state(cfg, opt, 0)
    first_params = minimal.from_minifield(state["params"], stacked_mlp)
    out = {}
    ours = [name for name in names if name in OURS]
    if ours:
        fp32 = jax.jit(project_model.loss_fn, static_argnums=1)(state["params"], cfg32, batch)
    for name in ours:
        with grouped_kernel(OURS[name]):  # None: the backend's (execution.GROUPED_KERNELS)
            step = jax.jit(make_train_step(cfg, opt), donate_argnums=(0,)).lower(state, batch)
        # each loop donates its own state: the first the one made here, the others a copy
        held = state if name == ours[0] else jax.tree_util.tree_map(jnp.array, state)
        out[name] = {"compiled": step.compile(), "held": held, "fp32": float(fp32[0])}
    mlps = {
        "minimal ragged_dot": sorted_mlp(ragged_product(cfg.dtype)),
        "minimal grouped": sorted_mlp(grouped_product(cfg)),
        "minimal gmm": sorted_mlp(gmm_product(cfg)),
        "dense": dense_mlp,
    }
    mlps32 = {
        "minimal ragged_dot": sorted_mlp(ragged_product(F32)),
        "minimal grouped": sorted_mlp(grouped_product(cfg32)),
        "dense": dense_mlp,
    }
    for name in names:
        if name in OURS:
            continue
        step, mopt, _ = minimal_step(cfg, mlps[name])
        params = jax.tree_util.tree_map(jnp.array, first_params)
        fp32 = float("nan")  # gmm has no FP32 form (tpu_grouped)
        if name in mlps32:
            fp32 = float(jax.jit(minimal_step(cfg32, mlps32[name])[2])(params, batch))
        held = (params, mopt.init(params))
        compiled = jax.jit(step, donate_argnums=(0, 1)).lower(*held, batch).compile()
        out[name] = {"compiled": compiled, "held": held, "fp32": fp32}
    for name, loop in out.items():
        loop["run"] = _runner(loop, name in OURS, batch)
        loop["first"] = loop["run"]()
    return out


def _runner(loop: dict, ours: bool, batch: dict):
    def run() -> tuple[float, float]:
        if ours:
            loop["held"], metrics = loop["compiled"](loop["held"], batch)
            return float(metrics["loss"]), float(metrics["grad_norm"])
        params, opt_state, value, norm = loop["compiled"](*loop["held"], batch)
        loop["held"] = (params, opt_state)
        return float(value), float(norm)

    return run


def _ratio(a: float, b: float) -> str:
    """``a / b`` to three places; "n/a" where ``b`` is 0 (an accelerator's update can take
    under the process clock's tick of host CPU)."""
    return f"{a / b:.3f}" if b else "n/a"


def measure(args, experts: int, names: tuple, batch: dict) -> dict:
    """Prints each loop's line; returns ``{name: median wall seconds per update}``."""
    load = os.getloadavg()[0]
    runs = loops(args, experts, names, batch)
    times = {(n, c): [] for n in names for c in ("wall", "cpu")}
    for r in range(args.rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            wall, cpu = time.perf_counter(), time.process_time()
            runs[name]["run"]()
            times[name, "wall"].append(time.perf_counter() - wall)
            times[name, "cpu"].append(time.process_time() - cpu)
    med = {key: statistics.median(v) for key, v in times.items()}
    print(f"{experts} experts, top {TOP_K} (load {load:.2f} -> {os.getloadavg()[0]:.2f}):")
    base = names[0]  # the loop every other is compared with
    for name in names:
        loss, norm = runs[name]["first"]
        ratio = (
            ""
            if name == base
            else f"; {base} / {name} = {med[base, 'wall'] / med[name, 'wall']:.3f} "
            f"wall, {_ratio(med[base, 'cpu'], med[name, 'cpu'])} CPU"
        )
        print(
            f"  {name:>18}: {med[name, 'wall']:.3f} s wall, {med[name, 'cpu']:.3f} s CPU per "
            f"update (rounds {[round(t, 3) for t in times[name, 'wall']]}){ratio}; first "
            f"update loss {loss:.6f}, grad norm {norm:.6f}; FP32 loss "
            f"{runs[name]['fp32']:.7f}",
            flush=True,
        )
    return {name: med[name, "wall"] for name in names}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--d-model", type=int, default=512)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--ffn", type=int, default=1024)
    parser.add_argument("--rows", type=int, default=2)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--dense-experts", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    args = parser.parse_args()
    print(
        f"d{args.d_model}, {args.layers} layers, GQA {HEADS}/{KV_HEADS}, experts of width "
        f"{args.ffn}, vocab {VOCAB}, {args.rows} x {args.seq} tokens, {args.dtype}; "
        f"{jax.device_count()} {jax.devices()[0].platform} device(s), {os.cpu_count()} cpus; "
        f"median of {args.rounds} interleaved rounds"
    )
    batch = minimal.packed_batch(args.rows, args.seq, VOCAB)
    measure(args, args.experts, ("minifield", "minimal ragged_dot", "minimal grouped"), batch)
    measure(args, args.dense_experts, ("minifield", "dense"), batch)


if __name__ == "__main__":
    main()
