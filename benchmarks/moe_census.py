"""Where a mixture-of-experts layer's time goes besides its grouped products: the layer's
forward and backward compiled at ``moe_chip.py``'s shape (abstract arguments, nothing
allocated), its kernels summed by stage and each stage's time estimated on a TPU v5e.

Programs, each ``grad`` of ``sum(layer(x) * cotangent)`` with respect to the input and the
FP32 parameters (what one layer of an update computes):

- ``ours``: :func:`minifield.models.moe.moe_mlp` as a TPU recipe runs it (``ragged_dot``), the
  experts held stacked FP32 ``[E, in, out]`` as the train state holds them;
- ``dense``: ``minimal/experts.py``'s every expert on every token (``moe_chip.py``'s dense
  line), the experts held stacked.

Stages are the named scopes ``moe_mlp`` puts on its kernels (``moe_router``, ``moe_sort``,
``moe_gather``, ``moe_experts``, ``moe_scatter``, forward and backward alike);
inside ``moe_experts`` the grouped products are told apart from the elementwise work around
them (SiLU, casts, the rows past the groups set to zero). Estimates: a kernel's bytes moved
(``_hlo_census``: operands and result) at ``--bandwidth`` (600 GB/s, a v5e's measured
copy rate is about that of its nominal 819), a product's FLOPs at ``--peak`` (164 TFLOP/s,
issue 49's measured BF16 peak), a product taking the longer of the two. On CPU JAX lowers
``ragged_dot`` densely (every row times every expert), which is not what the chip runs, so
there every ``ragged_dot`` is traced as an opaque stand-in (a host callback with the chip's
operands and result): its bytes are the real product's, its FLOPs ``2 x rows x in x out``.

``--for-chip`` compiles both for a TPU v5e on this CPU host instead (libtpu's compiler, the
``tpu`` extra, as ``tpu_compile.py``): the chip's own fusions and its ragged-dot kernels,
censused without a chip.

    uv run --locked python benchmarks/moe_census.py [--experts 16] [--json moe_census.json]
    python benchmarks/moe_census.py --backend tpu     # on the chip: its own fusions
    uv run --locked --extra tpu python benchmarks/moe_census.py --for-chip
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

#: (rows, seq, d_model, ffn): moe_chip.py's chip shape, and the test's
SHAPES = {"chip": (2, 2048, 1024, 3584), "tiny": (1, 32, 16, 24)}
STAGES = ("moe_router", "moe_sort", "moe_gather", "moe_experts", "moe_scatter")
#: the last name of a kernel's op_name that makes it a matrix product (the chip's grouped
#: products' kernels too: ``ragged-dot-none``, their offsets ``ragged-dot-metadata``, and
#: megablox's ``pallas_call`` under ``jit(gmm)`` or ``jit(tgmm)``)
PRODUCTS = ("dot_general", "pure_callback", "ragged_dot", "ragged_dot_general")
TOP_K = 2


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", help="a small shape (the test's)")
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--backend", choices=("cpu", "tpu"), default="cpu")
    parser.add_argument("--bandwidth", type=float, default=600e9, help="bytes/s")
    parser.add_argument("--peak", type=float, default=164e12, help="BF16 FLOP/s")
    parser.add_argument("--programs", nargs="+", choices=("ours", "dense"),
                        default=["ours", "dense"])  # fmt: skip
    parser.add_argument("--grouped-kernel", choices=("ragged_dot", "ragged_tgmm", "gmm"),
                        default="ragged_dot", help="ours' grouped product on the TPU "
                        "(execution.GROUPED_KERNELS names ragged_dot)")  # fmt: skip
    parser.add_argument("--gmm-tiling", type=int, nargs=3, metavar=("ROWS", "IN", "OUT"),
                        help="megablox's tiles for gmm and tgmm (tpu_grouped.GMM_TILING); "
                        "with --for-chip, whether the chip's compiler takes them")  # fmt: skip
    parser.add_argument("--for-chip", action="store_true", help="compile for a TPU v5e on this "
                        "CPU host (libtpu, the tpu extra); --backend cpu")  # fmt: skip
    parser.add_argument("--json", help="write the breakdown here")
    return parser.parse_args(argv)


@contextlib.contextmanager
def opaque_ragged_dot():
    """``jax.lax.ragged_dot`` and ``ragged_dot_general`` as host callbacks of the same
    result: one kernel moving what the chip's product moves (its backward is written out in
    ``tpu_grouped``, so nothing differentiates through them)."""
    import jax
    import numpy as np

    real = jax.lax.ragged_dot, jax.lax.ragged_dot_general

    def stand_in(fn):
        def call(lhs, rhs, sizes, *args, **kwargs):
            out = jax.eval_shape(lambda a, b, s: fn(a, b, s, *args, **kwargs), lhs, rhs, sizes)
            zeros = lambda *_: np.zeros(out.shape, out.dtype)  # noqa: E731
            return jax.pure_callback(zeros, out, lhs, rhs, sizes)

        return call

    jax.lax.ragged_dot, jax.lax.ragged_dot_general = map(stand_in, real)
    try:
        yield
    finally:
        jax.lax.ragged_dot, jax.lax.ragged_dot_general = real


def programs(args) -> dict:
    """``{name: (compiled HLO text, product FLOPs)}`` of the two layers."""
    import jax
    import jax.numpy as jnp
    from minimal.experts import dense_mlp
    from moe_update import grouped_kernel, megablox_tiles

    from minifield.models import moe
    from minifield.models.execution import Execution
    from minifield.models.llama import LlamaConfig

    rows, seq, D, F = SHAPES["tiny" if args.tiny else "chip"]
    E, N = args.experts, rows * seq
    cfg = LlamaConfig(
        vocab_size=64, d_model=D, n_layers=1, n_heads=2, n_kv_heads=1, d_ff=F, max_len=seq,
        compute_dtype="bfloat16", n_experts=E, experts_per_token=TOP_K,
        execution=Execution(backend="tpu"),
    )  # fmt: skip
    f32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)  # noqa: E731
    x = jax.ShapeDtypeStruct((rows, seq, D), jnp.bfloat16)
    ours_p = {"router": f32(D, E),
              "experts": {"w_gate": f32(E, D, F), "w_up": f32(E, D, F), "w_down": f32(E, F, D)}}  # fmt: skip
    dense_p = {"router": f32(D, E), "wg": f32(E, D, F), "wu": f32(E, D, F), "wd": f32(E, F, D)}

    def bf16_dot(eq, a, b):
        return jnp.einsum(eq, a.astype(jnp.bfloat16), b.astype(jnp.bfloat16),
                          preferred_element_type=jnp.float32)  # fmt: skip

    layers = {
        "ours": lambda x, p: moe.moe_mlp(cfg, x, p),
        "dense": lambda x, p: dense_mlp(p, x, bf16_dot, jnp.bfloat16),
    }
    # a grouped product's FLOPs (2 m k n over the N x top-k routed rows): the census counts
    # the products the compiler writes as dots; a grouped product's kernel (the chip's, or
    # the CPU's stand-in) it cannot see into counts this each
    grouped = 2 * N * TOP_K * D * F
    place, tracing = (lambda tree: tree), contextlib.nullcontext
    if args.for_chip:
        import tpu_compile

        place, tracing = tpu_compile.for_chip()
    out = {}
    for name, params in (("ours", ours_p), ("dense", dense_p)):
        if name not in args.programs:
            continue
        layer = layers[name]

        def loss(x, p, ct, layer=layer):
            return jnp.sum(layer(x, p).astype(jnp.float32) * ct)

        grad = jax.jit(jax.grad(loss, argnums=(0, 1)))
        arguments = place((x, params, f32(rows, seq, D)))
        cpu = jax.default_backend() == "cpu" and not args.for_chip
        with opaque_ragged_dot() if cpu else tracing(), grouped_kernel(args.grouped_kernel):
            with megablox_tiles(args.gmm_tiling):
                lowered = grad.lower(*arguments)
        out[name] = (lowered.compile().as_text(), grouped)
    return out


#: a kernel the census cannot see into that is one grouped product: the chip's ragged-dot
#: kernel, or the CPU's stand-in for it (:func:`opaque_ragged_dot`)
_OPAQUE = re.compile(
    r'custom-call\(.*op_name="[^"]*(ragged-dot-none|pure_callback|jit\(t?gmm\)/pallas_call)"'
)


def product_flops(text: str, found: dict, grouped: float) -> float:
    """The products' FLOPs of one compiled layer (``found``: its census): every dot and
    convolution the census counts but the router's, and ``grouped`` for each opaque grouped
    product."""
    opaque = sum(1 for line in text.splitlines() if _OPAQUE.search(line))
    written = sum(v for k, v in found["dot_flops_by_name"].items() if "moe_router" not in k)
    return written + grouped * opaque


def _stage(label: str, experts: int) -> str:
    """A kernel's stage from its census label (``kind shape op_name``): a product, the
    experts' matrices (cast, their gradients' zeroing: a result ``[experts, in, out]``
    outside the products), or its named scope."""
    kind, rest = label.split(" ", 1)
    op_name = rest.rsplit(" ", 1)[-1]
    last = op_name.rsplit("/", 1)[-1]
    megablox = last == "pallas_call" and ("jit(gmm)" in op_name or "jit(tgmm)" in op_name)
    if (
        kind in ("dot", "convolution")
        or last in PRODUCTS
        or last.startswith("ragged-dot")
        or megablox
    ):
        return "moe_router" if "nd,de->ne" in op_name else "products"
    stacked = rest.startswith((f"bf16[{experts},", f"f32[{experts},"))
    if stacked and "experts" in op_name:  # moe_experts' casts, or a parameter's own copy
        return "expert weights"
    if kind == "fusion:kOutput" and stacked and not op_name:
        # the TPU compiler's experts' matrix gradient: a product over every expert's rows,
        # its kernel left without the scope's name
        return "products"
    return next((stage for stage in STAGES if stage in op_name), "other")


def breakdown(text: str, grouped: float, experts: int, bandwidth: float, peak: float) -> dict:
    """``{stage: {"bytes", "ms"}}`` of one compiled layer, the grouped products
    at the longer of their FLOPs at ``peak`` and their bytes at ``bandwidth``."""
    import _hlo_census

    found = _hlo_census.census(text, top=10**6)
    stages = collections.defaultdict(lambda: {"bytes": 0.0})
    for label, moved in found["top"]:  # kernels of one label (kind, shape, op_name) summed
        stages[_stage(label, experts)]["bytes"] += moved
    for name, stage in stages.items():
        stage["ms"] = 1e3 * stage["bytes"] / bandwidth
        if name == "products":
            stage["flops"] = product_flops(text, found, grouped)
            stage["ms"] = max(stage["ms"], 1e3 * stage["flops"] / peak)
    return dict(stages)


def report(results: dict) -> str:
    lines = [f"  {'stage':<14}" + "".join(f"{n + ' GB':>12}{n + ' ms':>11}" for n in results)]
    names = sorted({s for r in results.values() for s in r}, key=lambda s: (s != "products", s))
    for stage in names:
        cells = [(r.get(stage, {}).get("bytes", 0) / 1e9, r.get(stage, {}).get("ms", 0))
                 for r in results.values()]  # fmt: skip
        lines.append(f"  {stage:<14}" + "".join(f"{gb:>12.3f}{ms:>11.2f}" for gb, ms in cells))
    totals = {n: sum(s["ms"] for s in r.values()) for n, r in results.items()}
    lines.append(f"  {'total':<14}" + "".join(f"{'':>12}{t:>11.2f}" for t in totals.values()))
    if {"ours", "dense"} <= set(totals):
        products = results["ours"]["products"]["ms"]
        lines.append(f"  ours besides its products: {totals['ours'] - products:.2f} ms "
                     f"({(totals['ours'] - products) / products:.2f} x the products)")  # fmt: skip
        lines.append(f"  the layer alone, dense ÷ ours: {totals['dense'] / totals['ours']:.2f}")
    return "\n".join(lines)


def main(argv=None) -> int:
    import _hlo_census

    args = parse_args(argv)
    if args.for_chip and not _hlo_census.compiles_for_chip("moe_census", args.backend):
        return 2
    if not _hlo_census.start_backend("moe_census", args.backend):
        return 2
    rows, seq, D, F = SHAPES["tiny" if args.tiny else "chip"]
    try:
        compiled = programs(args)
    except Exception as error:  # the compiler's refusal (a tiling past on-chip memory, say)
        if "RESOURCE_EXHAUSTED" not in str(error):
            raise
        print(f"moe_census: the compiler refused the layer: {str(error).splitlines()[0]}")
        return 1
    results = {
        name: breakdown(text, grouped, args.experts, args.bandwidth, args.peak)
        for name, (text, grouped) in compiled.items()
    }
    tiles = f" at megablox tiles {tuple(args.gmm_tiling)}" if args.gmm_tiling else ""
    print(f"MoE layer forward + backward: {rows} x {seq} tokens, d{D}, experts of width {F}, "
          f"top {TOP_K} of {args.experts}, BF16 compute, FP32 parameters; backend "
          f"{args.backend}{' (compiled for a TPU v5e)' if args.for_chip else ''}; ours' grouped "
          f"product {args.grouped_kernel}{tiles}; estimates at {args.bandwidth / 1e9:g} GB/s and "
          f"{args.peak / 1e12:g} TFLOP/s")  # fmt: skip
    print(report(results))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
