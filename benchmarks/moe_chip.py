"""Experts on the chip: a Mixtral-shaped update, minifield's against a minimal JAX loop, and
every expert run densely against minifield's grouped product, on one TPU chip (issue 49, item 4).

Mixtral-8x7B's shape scaled to fit a 16 GB chip (v5e): width 1024 (Mixtral 4096), experts of
width 3584 (14336: the same 3.5 times), 8 heads of 128 with 2 key/value heads, top 2 of
``--experts`` 8, ``--layers`` 2, a 512-token vocabulary, one packed batch of ``--rows`` 2 x
``--seq`` 2048, BF16 compute, no remat in either loop. minifield's model is told
``runtime.backend: tpu``, so its experts go through ``jax.lax.ragged_dot``
(``execution.grouped_kernel``), as a TPU recipe's. The loops, timing and checks are
``moe_update.py``'s (a training update each: forward, backward, clipping, AdamW; compiled ahead;
median of interleaved rounds; each loop's first loss and FP32 loss printed to show they compute
the same function). Printed at the end, the issue's two ratios of median update times:

- minifield ÷ the minimal ``ragged_dot`` loop at ``--experts`` 8 (issue: at most 1.1);
- the minimal loop with megablox's ``gmm`` ÷ with ``ragged_dot`` (BF16 only): which of the
  chip's two grouped products ``execution.GROUPED_KERNELS`` should name (below 1: ``gmm``);
- every expert on every token ÷ minifield at ``--dense-experts`` 16 (issue: at least 3);
- with BF16, minifield traced with ``ragged_tgmm`` (megablox's ``tgmm`` for the experts'
  gradient, which the chip's compiler otherwise runs over every expert's rows:
  docs/tpu.md) ÷ minifield, and dense ÷ it: whether ``execution.GROUPED_KERNELS`` should
  name it;
- with ``--tgmm-tilings``, that ratio again at each of megablox's tilings given (each timed
  beside minifield in rounds of its own): which tiles ``tpu_grouped.GMM_TILING`` should name.

On the chip (the memory the sizes take is an estimate until run there):

    python benchmarks/moe_chip.py
    python benchmarks/moe_chip.py --parts sparse --tgmm-tilings 512,512,512 1024,512,512

``--tiny`` runs a small shape (on CPU: a smoke check of the script, whose times mean nothing).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import jax

sys.path.insert(0, str(Path(__file__).resolve().parent))
import moe_update  # noqa: E402
from minimal import llama as minimal  # noqa: E402

#: (d_model, ffn, layers, rows, seq): Mixtral scaled to one 16 GB chip, and the smoke check's
SHAPES = {"chip": (1024, 3584, 2, 2, 2048), "tiny": (64, 128, 1, 1, 64)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", help="a small shape: a smoke check")
    parser.add_argument("--layers", type=int)
    parser.add_argument("--rows", type=int)
    parser.add_argument("--seq", type=int)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--dense-experts", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--gmm-tiling", type=int, nargs=3, metavar=("ROWS", "IN", "OUT"),
                        help="megablox's tiles for gmm and tgmm (tpu_grouped.GMM_TILING; "
                        "default 128 128 128): a sweep of them")  # fmt: skip
    parser.add_argument("--tgmm-tilings", nargs="+", type=_tiling, default=[], metavar="R,I,O",
                        help="megablox tiles to time minifield ragged_tgmm at, each beside "
                        "minifield at --experts (e.g. 128,128,128 512,512,512)")  # fmt: skip
    parser.add_argument("--parts", nargs="+", choices=("sparse", "dense"), default=["sparse", "dense"],
                        help="sparse: minifield against the minimal loops at --experts; dense: "
                        "every expert run densely against minifield at --dense-experts")  # fmt: skip
    args = parser.parse_args()
    d_model, ffn, layers, rows, seq = SHAPES["tiny" if args.tiny else "chip"]
    args.d_model, args.ffn, args.backend = d_model, ffn, "tpu"
    args.layers, args.rows, args.seq = args.layers or layers, args.rows or rows, args.seq or seq
    print(
        f"Mixtral-shaped: d{args.d_model}, {args.layers} layers, GQA {moe_update.HEADS}/"
        f"{moe_update.KV_HEADS}, experts of width {args.ffn}, top {moe_update.TOP_K}, "
        f"{args.rows} x {args.seq} tokens, {args.dtype}; minifield as runtime.backend tpu "
        f"(ragged_dot); {jax.device_count()} {jax.devices()[0].device_kind} device(s); median "
        f"of {args.rounds} interleaved rounds"
    )
    if args.gmm_tiling:
        from minifield.models.layers import tpu_grouped

        tpu_grouped.GMM_TILING = tuple(args.gmm_tiling)
        print(f"megablox tiles (gmm, tgmm): {tpu_grouped.GMM_TILING}")
    batch = minimal.packed_batch(args.rows, args.seq, moe_update.VOCAB)
    names = ("minifield", "minimal ragged_dot")
    if args.dtype == "bfloat16":
        names += ("minimal gmm", "minifield ragged_tgmm")
    if "sparse" in args.parts:
        sparse = moe_update.measure(args, args.experts, names, batch)
        ours_minimal = sparse["minifield"] / sparse["minimal ragged_dot"]
        print(
            f"minifield / minimal ragged_dot at {args.experts} experts: {ours_minimal:.3f} (≤ 1.1)"
        )
        if "minimal gmm" in sparse:
            gmm_ragged = sparse["minimal gmm"] / sparse["minimal ragged_dot"]
            print(f"minimal gmm / minimal ragged_dot at {args.experts} experts: {gmm_ragged:.3f}")
        if "minifield ragged_tgmm" in sparse:
            tgmm = sparse["minifield ragged_tgmm"] / sparse["minifield"]
            print(f"minifield ragged_tgmm / minifield at {args.experts} experts: {tgmm:.3f}")
    for tiling in args.tgmm_tilings:  # one tiling at a time beside minifield's ragged_dot
        tiles(args, tiling, batch)
    if "dense" in args.parts:
        ours = ("minifield",) + (("minifield ragged_tgmm",) if args.dtype == "bfloat16" else ())
        for name in ours:  # one of ours at a time beside dense: two states of 16 experts fit
            dense = moe_update.measure(args, args.dense_experts, (name, "dense"), batch)
            ratio = dense["dense"] / dense[name]
            print(f"dense / {name} at {args.dense_experts} experts: {ratio:.2f} (≥ 3)")


def _tiling(text: str) -> tuple[int, int, int]:
    """``R,I,O``: megablox's (rows, contracted, output) tile sizes."""
    sizes = tuple(int(size) for size in text.split(","))
    if len(sizes) != 3 or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"expected three positive sizes R,I,O, got {text!r}")
    return sizes


def tiles(args, tiling: tuple, batch) -> None:
    """minifield with ``ragged_tgmm`` at megablox's ``tiling`` ÷ minifield (``ragged_dot``,
    which no tiling touches: the same baseline for every tiling)."""
    with moe_update.megablox_tiles(tiling):
        found = moe_update.measure(
            args, args.experts, ("minifield", "minifield ragged_tgmm"), batch
        )
    ratio = found["minifield ragged_tgmm"] / found["minifield"]
    print(
        f"minifield ragged_tgmm at tiles {tiling} / minifield at {args.experts} experts: {ratio:.3f}"
    )


if __name__ == "__main__":
    main()
