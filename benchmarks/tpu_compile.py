"""Our training steps compiled for one TPU v5e chip on a CPU host (no chip), and what the
compiler says of their memory (docs/tpu.md, "Compiling for the chip on a CPU host").

JAX compiles ahead of time for a TPU topology it is only described (``jax.experimental.
topologies``: libtpu's compiler, the ``tpu`` extra: ``uv sync --extra tpu``), with every
argument a ``jax.ShapeDtypeStruct`` on the topology's device: nothing is allocated, so an 8B
step is compiled without its 16 GB of weights. A step whose temporaries exceed the HBM is
refused as on the chip (``RESOURCE_EXHAUSTED``: the compiler's "Used X of Y hbm" recorded as
the device check's ``shapes`` section records it, or its temporaries' figure); one that
compiles fits where its peak is at most the HBM (the ``shapes`` section's test). Each program is built by its benchmark's own code
(``_tpu_cases.py``): ``qlora`` (``qlora_step.py``'s step), ``shapes`` (the device check's
``shapes`` section) and ``step`` (its 125M / 350M step). The figures: the memory analysis'
parts, the peak as ``qlora_step.compiled_peak`` takes it (arguments + outputs +
temporaries - aliased), XLA's flops (``cost_analysis``, which counts a loop's body once: a
layer scan's recomputation shows there per layer, not times the layers) and the compile's
seconds; ``--out`` gets them as JSON, ``--hlo`` the optimized program.

The code picks some kernels by the running backend at trace time (``jax.default_backend()``,
the CPU's here: splash attention and the Pallas quantized product would be interpreted, the
loss's log-softmax another): while a program is traced it is told ``tpu``
(:func:`tpu_backend`), so the program is the chip's.

    uv sync --locked --extra tpu
    uv run --locked python benchmarks/tpu_compile.py qlora --preset llama-3.1-8b --mode nf4 \\
        --seq 2048 --batch 1 --remat full
    uv run --locked python benchmarks/tpu_compile.py shapes --model llama-3.2-3b --shapes-mode lora --rows 8
    uv run --locked python benchmarks/tpu_compile.py step --size 350m --remat dots_saveable
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _tpu_cases  # noqa: E402
import qlora_step  # noqa: E402
from device_check import section_shapes  # noqa: E402

from minifield.models.execution import AUTO_REMAT, REMAT_POLICIES  # noqa: E402
from minifield.strategies.base import compiled_memory  # noqa: E402

#: the chip: one v5e (``v5litepod-1``), its HBM as the compiler counts it (15.75 GiB)
TOPOLOGY = "v5e:1x1"
ACCELERATOR_TYPE = "v5litepod-1"
HBM_BYTES = int(15.75 * 2**30)
#: this host's CPU runs JAX; libtpu only compiles (the two variables quiet its start-up),
#: opening no chip: several compiles may run side by side (libtpu's lockfile guards a chip)
COMPILE_ONLY_ENVIRONMENT = {
    "TPU_ACCELERATOR_TYPE": ACCELERATOR_TYPE,
    "TPU_WORKER_HOSTNAMES": "localhost",
    "ALLOW_MULTIPLE_LIBTPU_LOAD": "1",
}
NO_LIBTPU = ("tpu_compile: libtpu is not installed: this compiles for a TPU with libtpu's "
             "compiler; install it with `uv sync --locked --extra tpu`")  # fmt: skip


def arguments(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    common = argparse.ArgumentParser(add_help=False)  # every case's
    common.add_argument("--out", type=Path, help="the JSON record")
    common.add_argument("--hlo", type=Path, help="the optimized program's text, written here")
    common.add_argument("--remat", choices=(*REMAT_POLICIES, AUTO_REMAT), help="training.remat "
                        "(absent: qlora none, as qlora_step.py; step the TPU's default, auto: "
                        "the plan a recipe of the model gets; shapes full)")  # fmt: skip
    common.add_argument("--loss-chunk-tokens", type=int, help="absent: 1024 (qlora_step.py's, "
                        "the TPU's default)")  # fmt: skip
    cases = parser.add_subparsers(dest="case", required=True)
    q = cases.add_parser(
        "qlora", parents=[common], help="qlora_step.py's LoRA step on a BF16 or quantized base"
    )
    q.add_argument("--preset", choices=sorted(qlora_step.PRESETS), default="llama-3.2-3b")
    q.add_argument("--mode", choices=qlora_step.MODES, default="nf4")
    q.add_argument("--kernel", choices=qlora_step.KERNELS, default="xla")
    q.add_argument("--seq", type=int, default=2048)
    q.add_argument("--batch", type=int, default=1)
    q.add_argument("--rank", type=int, default=16)
    q.add_argument("--block", type=int, help="absent: int8 per channel, NF4 64")
    q.add_argument("--no-double", action="store_true", help="NF4 without double quantization")
    q.add_argument("--attention", choices=("xla", "splash"), default="xla", help="xla: "
                   "qlora_step.py's (its recipe names no backend); splash: a TPU recipe's")  # fmt: skip
    q.add_argument("--optimizer", choices=("qlora_step", "pipeline"), default="qlora_step",
                   help="qlora_step.py's, or qlora_pipeline.py's recipe's (its schedule)")  # fmt: skip
    s = cases.add_parser(
        "shapes", parents=[common], help="the device check's shapes section's step"
    )
    s.add_argument("--model", choices=sorted(section_shapes.MODELS), default="llama-3.2-3b")
    s.add_argument("--shapes-mode", choices=section_shapes.MODES, default="lora")
    s.add_argument("--rows", type=int, default=1)
    t = cases.add_parser(
        "step", parents=[common], help="the device check's 125M / 350M step (ours)"
    )
    t.add_argument("--size", choices=("125m", "350m"), default="350m")
    t.add_argument("--rows", type=int, help="absent: the device check's (125m 16, 350m 8)")
    t.add_argument("--grad-accum-steps", type=int, default=1)
    args = parser.parse_args(argv)
    for name in ("seq", "batch", "rows", "grad_accum_steps", "rank"):
        value = getattr(args, name, None)
        if value is not None and value < 1:
            parser.error(f"--{name.replace('_', '-')}: expected an integer >= 1, got {value}")
    if args.loss_chunk_tokens is not None and args.loss_chunk_tokens < 0:
        parser.error(f"--loss-chunk-tokens: expected an integer >= 0, got {args.loss_chunk_tokens}")
    if args.case == "qlora":
        args.remat = args.remat or "none"
        args.loss_chunk_tokens = 1024 if args.loss_chunk_tokens is None else args.loss_chunk_tokens
    if args.case == "step" and args.rows is None:
        from device_check.settings import BATCH

        args.rows = BATCH[args.size]
    return args


def libtpu_installed() -> bool:
    return importlib.util.find_spec("libtpu") is not None


def chip_device():
    """The one device of a v5e topology, compiled for from this (CPU) host."""
    from jax.experimental import topologies

    topology = topologies.get_topology_desc(
        platform="tpu", topology_name=TOPOLOGY, chip_config_name="default",
        chips_per_host_bounds=(1, 1, 1), num_slices=1,
    )  # fmt: skip
    return topology.devices[0]


def on_device(tree, device):
    """``tree``'s shapes and dtypes on ``device`` (as the step's arguments are on the chip): a
    frozen base's ``host`` paths in its host memory (``pinned_host``), as placed."""
    import jax
    from jax.sharding import SingleDeviceSharding

    from minifield.hf import stored_base

    shardings = {kind: SingleDeviceSharding(device, memory_kind=kind)
                 for kind in ("device", "pinned_host")}  # fmt: skip

    def placed(t, kind="device"):
        def one(a):
            return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=shardings[kind])

        return jax.tree_util.tree_map(one, t)

    def part(x):
        if not (isinstance(x, stored_base.FrozenBase) and x.host):
            return placed(x)
        items = [(path, placed(value, "pinned_host" if path in x.host else "device"))
                 for path, value in stored_base.flatten(x.params)]  # fmt: skip
        return stored_base.FrozenBase(stored_base.nest(items), x.out_in, x.dtype, x.host)

    return jax.tree_util.tree_map(
        part, tree, is_leaf=lambda x: isinstance(x, stored_base.FrozenBase)
    )


def compile_only(script: str) -> bool:
    """Set this process up to compile for the chip with libtpu (before JAX starts): False,
    with a line on stderr naming ``script``, where libtpu is not installed."""
    if not libtpu_installed():
        print(f"{script}: {NO_LIBTPU.split(': ', 1)[1]}", file=sys.stderr)
        return False
    os.environ["JAX_PLATFORMS"] = "cpu"
    for name, value in COMPILE_ONLY_ENVIRONMENT.items():
        os.environ.setdefault(name, value)
    return True


def for_chip():
    """``(place, tracing)`` of a program compiled for the chip from this host: its abstract
    arguments put on a v5e's device (:func:`on_device`), and the context it is traced in
    (:func:`tpu_backend`), as :func:`run` compiles; the censuses' ``--for-chip``."""
    device = chip_device()
    return (lambda tree: on_device(tree, device)), tpu_backend


@contextlib.contextmanager
def tpu_backend():
    """``jax.default_backend()`` says ``tpu`` while a program is traced: what our code reads to
    pick a TPU kernel (see the module). JAX's own code asks its backend module, not this name."""
    import jax

    running = jax.default_backend
    jax.default_backend = lambda: "tpu"
    try:
        yield
    finally:
        jax.default_backend = running


def compiled_figures(jitted, arguments, hlo: Path | None = None) -> dict:
    """Compile ``jitted`` for ``arguments``: the memory analysis' parts, the peak, XLA's flops
    and the seconds; a program that does not fit: the compiler's figure and its message."""
    started = time.perf_counter()
    try:
        with tpu_backend():
            lowered = jitted.lower(*arguments)
        compiled = lowered.compile()
    except Exception as exc:  # the compiler refuses a program that does not fit the chip
        if not section_shapes.out_of_memory(exc):
            raise
        text = str(exc)
        return {"fits": False, "compile_s": round(time.perf_counter() - started, 2),
                "compiler_used_bytes": section_shapes._used_bytes(text),
                "compiler_temp_bytes": _temporaries(text), "error": text[:600]}  # fmt: skip
    seconds = time.perf_counter() - started
    if hlo is not None:
        hlo.write_text(compiled.as_text())
    memory = compiled_memory(compiled)
    parts = {f"{name}_bytes": memory[key] for name, key in (("argument", "arguments"),
             ("output", "outputs"), ("temp", "temporaries"), ("alias", "aliased"))}  # fmt: skip
    # what the program keeps in the host's memory (``remat: offload_attention``)
    parts["host_temp_bytes"] = int(compiled.memory_analysis().host_temp_size_in_bytes)
    analysis = compiled.cost_analysis()
    analysis = analysis[0] if isinstance(analysis, list) else analysis
    peak = memory["peak"]
    # compiled is not enough: the compiler refuses temporaries above the HBM, the arguments
    # beside them are the runtime's to allocate (the device check's limit is the peak's)
    return {"fits": peak <= HBM_BYTES, "peak_bytes": peak, **parts,
            "flops": float(analysis.get("flops", 0.0)), "compile_s": round(seconds, 2)}  # fmt: skip


#: the other form of the compiler's refusal: the temporaries alone above the HBM
_TEMPORARIES = re.compile(r"memory required for HLO temporaries \(([0-9.]+)([KMGT])?\)")


def _temporaries(text: str) -> int | None:
    """The temporaries' bytes a refusal names ("... for HLO temporaries (18.12G) exceeds
    available HBM (15.75G)"), or None."""
    found = _TEMPORARIES.search(text)
    if not found:
        return None
    scale = {None: 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}[found.group(2)]
    return int(float(found.group(1)) * scale)


def run(args) -> dict:
    device = chip_device()
    build = {"qlora": _tpu_cases.qlora, "shapes": _tpu_cases.shapes, "step": _tpu_cases.step}
    jitted, arguments, described = build[args.case](args)
    record = {"argv": sys.argv[1:], "device_kind": device.device_kind, "topology": TOPOLOGY,
              "hbm_bytes": HBM_BYTES, "settings": _settings(args), **described}  # fmt: skip
    record["abstract_argument_bytes"] = _tpu_cases.nbytes(arguments)
    record.update(compiled_figures(jitted, on_device(arguments, device), args.hlo))
    return record


def _settings(args) -> dict:
    return {k: v for k, v in vars(args).items() if k not in ("out", "hlo")}


def _line(record: dict) -> str:
    if "peak_bytes" not in record:
        used, temp = record["compiler_used_bytes"], record["compiler_temp_bytes"]
        said = "no figure" if used is None else f"the compiler used {used / 2**30:.2f} GiB"
        said = said if temp is None else f"temporaries alone {temp / 2**30:.2f} GiB"
        return f"does not fit ({said}): {record['error'][:300]}"
    fits = "fits" if record["fits"] else f"does not fit {HBM_BYTES / 2**30} GiB"
    return (f"{fits}: peak {record['peak_bytes']:,} B ({record['peak_bytes'] / 2**30:.3f} GiB): "
            f"arguments {record['argument_bytes'] / 2**30:.3f}, outputs "
            f"{record['output_bytes'] / 2**30:.3f}, temporaries {record['temp_bytes'] / 2**30:.3f}, "
            f"aliased {record['alias_bytes'] / 2**30:.3f} GiB; {record['flops']:.4e} flops; "
            f"compiled in {record['compile_s']} s")  # fmt: skip


def main(argv=None) -> int:
    args = arguments(argv)
    if not compile_only("tpu_compile"):
        return 2
    record = run(args)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
    print(_line(record))
    return 0


if __name__ == "__main__":
    sys.exit(main())
