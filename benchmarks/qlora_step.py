"""LoRA train step on a quantized frozen base (int8, NF4) ÷ the same step on the BF16 base,
and each one's peak memory (docs/quantized-base.md).

The base: a random Llama as an HF checkpoint (BF16 safetensors, one shard per layer, the
index, ``config.json``; ``_random_base.py``), kept in ``--dir`` with each scheme's codes and
scales (``_qlora_base.py``: made once on the host by threads, in the quantized-base product's
format, while the first modes run; shared by the scheme's kernels and later calls). Each mode
runs in its own process (its peak its own: the device's ``peak_bytes_in_use`` on an
accelerator, the process's peak resident memory on CPU): it maps the base, reads its product,
and places the base as a worker given that product does
(:func:`minifield.strategies.lm.placement.frozen_base`, layers stacked once). LoRA on every
linear layer (QLoRA's setting), AdamW, BF16 compute, the state donated; compiled and run once
untimed, then the median of ``--steps``. Each mode also prints the layer-matrix-shaped arrays
its optimized program writes outside every fusion (:func:`materialised`): 0 where each
made-back matrix is fused into its product. ``--kernels xla pallas`` runs each quantized mode
with each product (``Execution``'s ``quantized_kernel``: XLA's fused ``dequantize``, or the
Pallas kernel, :mod:`minifield.models.layers.tpu_quantized`), the BF16 step once. ``--out``
gets the JSON (modes, phases' seconds) after each mode; ``--budget`` seconds bound the call.

    uv run python benchmarks/qlora_step.py                      # CPU: a small shape
    python3 benchmarks/qlora_step.py --preset llama-3.2-3b --seq 2048 --batch 1 --remat full \\
        --steps 5 --dir /tmp/llama3b --kernels xla pallas --budget 500 --out $OUT/q3b.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _qlora_base  # noqa: E402

from minifield import atomic  # noqa: E402

MODES = ("bf16", "int8", "nf4")
#: a quantized base's products (``execution.QUANTIZED_KERNEL_KINDS``)
KERNELS = ("xla", "pallas")
#: the shapes of their HF config.json (Llama 3's rotary scaling changes no shape: left out)
PRESETS = {
    "llama-3.1-8b": dict(d_model=4096, layers=32, heads=32, kv_heads=8, ff=14336, vocab=128256,
                         rope_theta=500000.0, tied=False),
    "llama-3.2-3b": dict(d_model=3072, layers=28, heads=24, kv_heads=8, ff=8192, vocab=128256,
                         rope_theta=500000.0, tied=True),
    # the evaluate stage's host memory against the base's size on a CPU (docs/quantized-base.md)
    "llama-3.2-1b": dict(d_model=2048, layers=16, heads=32, kv_heads=8, ff=8192, vocab=128256,
                         rope_theta=500000.0, tied=True),
    "small": dict(d_model=256, layers=4, heads=8, kv_heads=2, ff=768, vocab=2048,
                  rope_theta=10000.0, tied=False),
    # qlora_pipeline.py's test: the Llama demo's tokenizer (33 ids) fits its vocabulary
    "tiny": dict(d_model=64, layers=2, heads=4, kv_heads=2, ff=128, vocab=64,
                 rope_theta=10000.0, tied=False),
}  # fmt: skip


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="small")
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--block", type=int, default=None, help="absent: int8 per channel, NF4 64")
    parser.add_argument("--no-double", action="store_true", help="NF4 without double quantization")
    parser.add_argument("--remat", choices=("none", "full", "dots_saveable"), default="none")
    parser.add_argument("--peak-tflops", type=float, default=197.0, help="for MFU (v5e: 197)")
    parser.add_argument("--dir", type=Path, default=Path("/tmp/minifield-qlora-base"))
    parser.add_argument(
        "--modes",
        nargs="+",
        choices=MODES,
        default=list(MODES),
        help="the bases to run (the ratios need bf16 in the same call)",
    )
    parser.add_argument(
        "--write-only",
        action="store_true",
        help="write the base to --dir and stop (a chip call of its own)",
    )
    parser.add_argument(
        "--kernels",
        nargs="+",
        choices=KERNELS,
        default=["xla"],
        help="the quantized modes' products (each mode run with each)",
    )
    parser.add_argument(
        "--quantized-tiles",
        type=_tiles,
        default=None,
        help="the Pallas kernel's tiles M,N,K (absent: tpu_quantized.TILES)",
    )
    parser.add_argument(
        "--budget", type=float, default=None, help="seconds for the whole call (absent: none)"
    )
    parser.add_argument("--out", type=Path, default=None, help="the JSON, after each mode")
    parser.add_argument("--mode", choices=MODES, help=argparse.SUPPRESS)  # one child's
    parser.add_argument("--kernel", choices=KERNELS, default="xla", help=argparse.SUPPRESS)
    return parser.parse_args()


def _tiles(text: str) -> tuple[int, int, int]:
    sizes = tuple(int(t) for t in text.split(","))
    if len(sizes) != 3 or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"expected three positive sizes M,N,K, got {text!r}")
    return sizes


def base_config(args):
    """The base's config (no JAX: the parent draws and writes it)."""
    from minifield.models.llama_config import LlamaConfig

    shape = PRESETS[args.preset]
    return LlamaConfig(
        vocab_size=shape["vocab"],
        d_model=shape["d_model"],
        n_layers=shape["layers"],
        n_heads=shape["heads"],
        n_kv_heads=shape["kv_heads"],
        d_ff=shape["ff"],
        max_len=args.seq,
        rope_theta=shape["rope_theta"],
        compute_dtype="bfloat16",
        tie_embeddings=shape["tied"],
    )


def config(args):
    from minifield.models import execution

    cfg = base_config(args)
    # the loss in chunks of 1024 tokens, as a TPU recipe's default: no [B, T, vocab] logits
    how = execution.Execution(
        scan_layers=True, remat=args.remat, loss_chunk_tokens=1024, quantized_kernel=args.kernel
    )
    return dataclasses.replace(cfg, execution=how)


def run_mode(args) -> dict:
    import jax

    from minifield.models.layers import tpu_quantized
    from minifield.strategies.lm import placement
    from minifield.training import lora, optimizer

    if args.quantized_tiles:
        tpu_quantized.TILES = args.quantized_tiles  # read as each product is traced
    cfg = config(args)
    scheme = None if args.mode == "bf16" else args.mode
    seconds, start = {}, time.perf_counter()
    found = scheme and _qlora_base.settings(scheme, args.block, args.no_double)
    arrays = _qlora_base.arrays(args.dir, args.seq, found)
    seconds["load"] = time.perf_counter() - start
    targets = tuple(name for name, dense in lora.TARGETS.items() if dense)  # every linear layer
    settings = lora.LoraSettings(
        args.rank,
        float(2 * args.rank),
        targets,
        "bfloat16",
        scheme,
        args.block,
        scheme == "nf4" and not args.no_double,
    )
    # as the worker places it: one device, the layers scanned (stacked once)
    start = time.perf_counter()
    base = jax.block_until_ready(placement.frozen_base(arrays, {}, settings, scan_layers=True))
    seconds["place"] = time.perf_counter() - start
    training = {"warmup_steps": 2, "learning_rate": 1e-4}
    opt = optimizer.make_optimizer(training, 1000)
    step = jax.jit(
        lora.make_train_step(cfg, settings, opt, optimizer.make_schedule(training, 1000)),
        donate_argnums=(0,),
    )
    state = lora.init_state(cfg, settings, opt, 0, np.zeros(32, np.uint8))
    batch = _batch(args, cfg.vocab_size)
    start = time.perf_counter()
    compiled = step.lower(state, base, batch).compile()
    seconds["compile"] = time.perf_counter() - start
    written = materialised(compiled.as_text(), layer_matrices(cfg))
    analysis = compiled.cost_analysis()
    flops = float((analysis[0] if isinstance(analysis, list) else analysis).get("flops", 0.0))
    start = time.perf_counter()
    state, _ = compiled(state, base, batch)
    jax.block_until_ready(state)
    seconds["first_step"] = time.perf_counter() - start
    times = []
    for _ in range(args.steps):
        start = time.perf_counter()
        state, metrics = compiled(state, base, batch)
        jax.block_until_ready(state)
        times.append(time.perf_counter() - start)
    stats = jax.devices()[0].memory_stats() or {}
    peak = (
        stats.get("peak_bytes_in_use") or resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    )
    return {
        "mode": args.mode,
        "kernel": args.kernel,
        "step_s": statistics.median(times),
        "peak_bytes": int(peak),
        "peak_of": "device" if "peak_bytes_in_use" in stats else "process RSS",
        "compiled_peak_bytes": compiled_peak(compiled),
        "estimated_bytes": estimated(args, targets, scheme),
        "flops": flops,
        "loss": float(metrics["loss"]),
        "written": {shape: written.count(shape) for shape in sorted(set(written))},
        "seconds": {phase: round(t, 3) for phase, t in seconds.items()},
    }


def layer_matrices(cfg) -> list[tuple[int, int]]:
    """A layer's ``[in, out]`` matrices: q, k (and v), o, gate (and up), down."""
    heads, kv = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    return [(cfg.d_model, heads), (cfg.d_model, kv), (heads, cfg.d_model),
            (cfg.d_model, cfg.d_ff), (cfg.d_ff, cfg.d_model)]  # fmt: skip


_HEADER = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) \(.*\{$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%?[\w.\-]+ = (.*?) ([a-z][\w\-]*)\(")
_ARRAY = re.compile(r"\b(f32|bf16|f16)\[([\d,]+)\]")
_FUSED = re.compile(r"\bfusion\(.*?calls=%?([\w.\-]+)")
#: no array of their own: views, and a loop's state (what its body writes is counted there)
_VIEWS = ("parameter", "get-tuple-element", "tuple", "bitcast", "while")


def _matrix_shaped(shape: list[int], matrices) -> bool:
    """``shape`` is ``[in, out]`` or ``[out, in]`` of one of ``matrices``, leading 1s aside, or
    ``[in, out]`` with its input axis split in two (as blocks: ``[in / block, block, out]``)."""
    while len(shape) > 2 and shape[0] == 1:
        shape = shape[1:]
    for k, n in matrices:
        if shape in ([k, n], [n, k]) or (
            len(shape) == 3 and shape[0] * shape[1] == k and shape[2] == n
        ):
            return True
    return False


def materialised(hlo_text: str, matrices) -> list[str]:
    """The floating-point arrays of an optimized HLO module shaped as one of ``matrices``
    (``(in, out)`` pairs, see :func:`_matrix_shaped`) that an instruction outside every fusion
    writes to memory: a dequantized matrix fused into the product that reads it is not one of
    them. Each as ``"dtype[dims] opcode"``. Told apart by shape alone: a step whose tokens
    equal a matrix's input width would confuse them."""
    fused = set(_FUSED.findall(hlo_text))
    found, inside = [], False
    for line in hlo_text.splitlines():
        header = _HEADER.match(line)
        if header:
            inside = header.group(1) in fused
            continue
        instruction = None if inside else _INSTRUCTION.match(line)
        if instruction is None or instruction.group(2) in _VIEWS:
            continue
        for dtype, dims in _ARRAY.findall(instruction.group(1)):
            if _matrix_shaped([int(d) for d in dims.split(",")], matrices):
                found.append(f"{dtype}[{dims}] {instruction.group(2)}")
    return found


def compiled_peak(compiled) -> int | None:
    """The compiled step's peak, as the device check's ``shapes`` section reads it: arguments
    (the base's codes among them) + outputs + temporaries - the outputs aliased to donated
    arguments (``peak_bytes_in_use`` misses the temporaries)."""
    from minifield.strategies.base import compiled_memory

    memory = compiled_memory(compiled)
    return None if memory is None else memory["peak"]


def estimated(args, targets, scheme) -> int:
    """What ``runtime.device_memory_bytes``' check estimates for this step
    (``minifield.models.device_memory``), to set beside the compiled peak."""
    from minifield.models import device_memory

    lora = {"rank": args.rank, "targets": list(targets), "base_dtype": "bfloat16"}
    if scheme:
        double = scheme == "nf4" and not args.no_double
        lora.update(
            base_quantization=scheme, quantization_block=args.block, double_quantization=double
        )
    training = {"batch_size": args.batch, "seq_len": args.seq, "remat": args.remat,
                "loss_chunk_tokens": 1024}  # fmt: skip
    recipe = {"model": {"scan_layers": True, "lora": lora}, "training": training}
    return device_memory.estimate(base_config(args), recipe)["total"]


def _batch(args, vocab: int):
    from minifield.data.packing import Rows

    rng = np.random.default_rng(0)
    tokens = rng.integers(0, vocab, (args.batch, args.seq)).astype(np.int32)
    positions = np.broadcast_to(np.arange(args.seq, dtype=np.int32), tokens.shape).copy()
    return Rows(
        tokens=tokens,
        segments=np.ones_like(tokens),
        positions=positions,
        loss_mask=np.ones(tokens.shape, np.float32),
    )


def main() -> None:
    args = arguments()
    if args.mode:
        print(json.dumps(run_mode(args)))
        return
    from minifield.supervision import accelerator

    # only a worker opens the accelerator: on a TPU a parent that so much as lists devices
    # holds the chip until it exits, and every mode's process would die on libtpu's lockfile
    accelerator.keep_off()
    deadline = None if args.budget is None else time.monotonic() + args.budget
    report = {"argv": sys.argv[1:], "seconds": {}, "results": {}, "failed": {}}
    report["seconds"]["write_base"] = _qlora_base.write_base(args.dir, base_config(args))
    _save(args, report)
    if args.write_only:
        return
    founds = {m: _qlora_base.settings(m, args.block, args.no_double) for m in args.modes}
    founds.pop("bf16", None)
    products = _qlora_base.Products(args.dir, list(founds.values()))  # beside the first modes
    runs = [(m, k) for m in args.modes for k in (["xla"] if m == "bf16" else args.kernels)]
    for mode, kernel in runs:  # one that fails (the BF16 8B base does not fit 16 GB) is reported
        name = mode if mode == "bf16" or args.kernels == ["xla"] else f"{mode}/{kernel}"
        failed = _run(args, mode, kernel, founds.get(mode), products, deadline, report)
        if failed:
            report["failed"][name] = failed
            print(f"{name}: {failed}")
        else:
            report["results"][name] = report.pop("last")
        report["seconds"]["quantize"] = {f[0]: t for f, t in products.seconds.items()}
        report["seconds"]["elapsed"] = args.budget and args.budget - _left(deadline)
        _save(args, report)
    _summary(args, report["results"])


def _left(deadline: float | None) -> float | None:
    return None if deadline is None else max(0.0, deadline - time.monotonic())


def _run(args, mode, kernel, found, products, deadline, report) -> str | None:
    """One mode's process, its result in ``report["last"]``; None, or why it has none."""
    if found is not None:
        why = products.wait(found, _left(deadline))
        if why:
            return why
    if deadline is not None and _left(deadline) < 1:
        return "not run: out of the budget"
    command = [sys.executable, __file__, *sys.argv[1:], "--mode", mode, "--kernel", kernel]
    from minifield.supervision import accelerator

    start = time.perf_counter()
    try:
        out = subprocess.run(
            command, capture_output=True, text=True, env=accelerator.worker_env(),
            timeout=_left(deadline),
        )  # fmt: skip
    except subprocess.TimeoutExpired:
        return f"stopped at the budget after {time.perf_counter() - start:.0f} s"
    if out.returncode != 0:
        return f"failed (exit {out.returncode}): {out.stderr.strip()[-300:]}"
    report["last"] = json.loads(out.stdout.strip().splitlines()[-1])
    report["last"]["seconds"]["process"] = round(time.perf_counter() - start, 3)
    return None


def _save(args, report: dict) -> None:
    if args.out is not None:
        atomic.write_json(args.out, report)


def _summary(args, results: dict) -> None:
    tokens = args.batch * args.seq
    print(
        f"{args.preset}, batch {args.batch} x seq {args.seq}, LoRA rank {args.rank} on every linear layer"
    )
    for mode, r in results.items():
        mfu = r["flops"] / r["step_s"] / (args.peak_tflops * 1e12)
        ratio = r["step_s"] / results["bf16"]["step_s"] if "bf16" in results else float("nan")
        print(
            f"{mode:11s} {r['step_s'] * 1e3:9.1f} ms/step  ÷ bf16 {ratio:.2f}  "
            f"peak {r['peak_bytes'] / 2**30:6.2f} GiB ({r['peak_of']})  "
            f"compiled {(r['compiled_peak_bytes'] or 0) / 2**30:7.3f} GiB  "
            f"estimated {r['estimated_bytes'] / 2**30:7.3f} GiB  "
            f"{tokens / r['step_s']:,.0f} tokens/s  MFU {mfu:.3f}  loss {r['loss']:.6f}"
        )
    print("layer-matrix-shaped arrays written outside fusions (0: each made-back matrix fused")
    print("into its product; see docs/quantized-base.md):")
    for mode, r in results.items():
        print(f"{mode:11s} {sum(r['written'].values())}: {r['written']}")


if __name__ == "__main__":
    main()
