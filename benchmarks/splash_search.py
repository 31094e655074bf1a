"""The search of ``splash_blocks.py``, apart from the kernels: which blocks to time in each
round, the fastest of them, the best joined, the table. Pure (no JAX), so it is tested on
made-up timings (``tests/test_splash_blocks.py``)."""

from __future__ import annotations

from minifield.models import splash_table

#: each kernel's (query block, key block, compute block) fields (dq has no compute block)
KERNELS = {
    "forward": ("block_q", "block_kv", "block_kv_compute"),
    "dkv": ("block_q_dkv", "block_kv_dkv", "block_kv_dkv_compute"),
    "dq": ("block_q_dq", "block_kv_dq", None),
}


def held(seq_len: int, size: int) -> dict:
    """Every block at ``size``, fitted to the row."""
    return splash_table.splash_blocks(
        seq_len, dict.fromkeys(splash_table.SPLASH_DEFAULT_BLOCKS, size)
    )


def with_sizes(seq_len: int, base: dict, sizes: dict) -> dict | None:
    """``base`` with ``sizes`` set; None where the row cannot take them as given (the sweep
    times only sizes the kernel runs unchanged)."""
    asked = {**base, **sizes}
    return asked if splash_table.splash_blocks(seq_len, asked) == asked else None


def first_round(seq_len: int, base: dict, candidates, runs=()) -> list[tuple[str, dict]]:
    """(kernel, blocks) to time first: each kernel's query block over the candidates, then
    its key block, every other block at ``base`` (the compute block too, where it divides
    the key block; else the key block)."""
    plan = []
    for kernel, (q, kv, compute) in KERNELS.items():
        for size in candidates:
            plan.append((kernel, with_sizes(seq_len, base, {q: size})))
            # the compute block held too, or lowered to a key block below it
            key_block = {kv: size, **({compute: min(size, base[compute])} if compute else {})}
            plan.append((kernel, with_sizes(seq_len, base, key_block)))
    return unique(plan)


def fastest(runs: list[dict], kernel: str, base: dict | None = None, fields=()) -> dict:
    """The blocks of ``kernel``'s fastest run (with ``base``: of those differing from it in
    ``fields`` at most)."""
    mine = [r for r in runs if r["kernel"] == kernel]
    if base is not None:
        mine = [r for r in mine if all(r["blocks"][n] == base[n] for n in base if n not in fields)]
    return min(mine, key=lambda r: r["ms"])["blocks"]


def second_round(seq_len: int, base: dict, candidates, runs) -> list[tuple[str, dict]]:
    """Each kernel at its fastest query block and key block of the first round together,
    its compute block at the key block and at each candidate below that divides it."""
    plan = []
    for kernel, (q, kv, compute) in KERNELS.items():
        best_q = fastest(runs, kernel, base, {q})[q]
        best_kv = fastest(runs, kernel, base, {kv, compute})[kv]
        computes = [best_kv] if compute else [None]
        if compute:
            computes += [c for c in candidates if c < best_kv and best_kv % c == 0]
        for size in computes:
            sizes = {q: best_q, kv: best_kv, **({compute: size} if compute else {})}
            plan.append((kernel, with_sizes(seq_len, base, sizes)))
    return unique(plan)


def joined(runs: list[dict]) -> dict:
    """The three kernels' fastest blocks in one ``BlockSizes``."""
    blocks = {}
    for kernel, fields in KERNELS.items():
        best = fastest(runs, kernel)
        blocks.update({name: best[name] for name in fields if name})
    return blocks


def unique(plan):
    seen, out = set(), []
    for kernel, blocks in plan:
        key = (kernel, tuple(sorted(blocks.items()))) if blocks else None
        if blocks and key not in seen:
            seen.add(key)
            out.append((kernel, blocks))
    return out


def table(shapes: list[dict]) -> dict:
    """``{row length: {head width: blocks}}`` of the complete shapes: ``SPLASH_BLOCKS``'s
    form (JSON's keys are strings: ``int`` them to paste)."""
    best: dict = {}
    for shape in shapes:
        if shape.get("complete"):
            best.setdefault(shape["seq_len"], {})[shape["head_dim"]] = shape["best"]["blocks"]
    return best
