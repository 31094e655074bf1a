"""Splash attention's block sizes on the chip: the table measured there
(:data:`SPLASH_BLOCKS`, by row length and head width), splash's own defaults for every other
shape, and the sizes a row gets (:func:`splash_blocks`). A recipe with splash records the
table's digest (``model.splash_table``, :func:`splash_table_digest`), so its computation
digest follows the table (:func:`.execution.splash_table_problems`). Imports no JAX."""

from __future__ import annotations

#: splash's own block sizes (``BlockSizes.get_default()``): what a row gets where
#: :data:`SPLASH_BLOCKS` has no measured entry for it
SPLASH_DEFAULT_BLOCKS = {
    "block_q": 128,
    "block_kv": 128,
    "block_kv_compute": 128,
    "block_q_dkv": 128,
    "block_kv_dkv": 128,
    "block_kv_dkv_compute": 128,
    "block_q_dq": 128,
    "block_kv_dq": 128,
}


def _blocks(*sizes: int) -> dict:
    """Splash's eight block sizes in :data:`SPLASH_DEFAULT_BLOCKS`' order."""
    return dict(zip(SPLASH_DEFAULT_BLOCKS, sizes, strict=True))


#: splash's block sizes measured on the chip, ``{row length: {head width: sizes}}``: the
#: ``best`` of ``benchmarks/splash_blocks.py``'s sweep on a TPU v5e (2026-12-06,
#: ``docs/splash-blocks.json``; figures in ``docs/tpu.md``), each kernel's blocks swept on its
#: own, joined, and kept only where the joined step beat every block at 512 (else all 512).
#: Every other shape gets :data:`SPLASH_DEFAULT_BLOCKS` (:func:`splash_blocks`).
SPLASH_BLOCKS = {
    128: {
        64: _blocks(128, 128, 128, 128, 128, 128, 128, 128),
        128: _blocks(128, 128, 128, 128, 128, 128, 128, 128),
    },
    256: {
        64: _blocks(256, 256, 256, 256, 256, 128, 256, 256),
        128: _blocks(256, 256, 256, 256, 256, 256, 256, 256),
    },
    512: {
        64: _blocks(512, 512, 512, 512, 512, 512, 512, 512),
        128: _blocks(512, 512, 512, 512, 512, 512, 512, 512),
    },
    1024: {
        64: _blocks(512, 512, 512, 512, 512, 512, 512, 512),
        128: _blocks(512, 1024, 512, 1024, 1024, 1024, 1024, 1024),
    },
    2048: {
        64: _blocks(512, 1024, 512, 512, 512, 512, 1024, 1024),
        128: _blocks(512, 512, 512, 512, 512, 512, 512, 512),
    },
    4096: {
        64: _blocks(1024, 1024, 512, 1024, 1024, 256, 1024, 1024),
        128: _blocks(1024, 1024, 512, 1024, 1024, 256, 1024, 1024),
    },
    8192: {
        64: _blocks(512, 512, 512, 512, 512, 512, 512, 512),
        128: _blocks(1024, 2048, 512, 1024, 1024, 1024, 512, 2048),
    },
}
#: splash tiles keys in multiples of the TPU's 128 lanes (its blocks must be multiples of it)
SPLASH_LANES = 128


def splash_table_blocks(seq_len: int, head_dim: int | None) -> dict:
    """:data:`SPLASH_BLOCKS`'s sizes for rows of ``seq_len`` tokens of heads ``head_dim``
    wide: the entry of that head width at the longest measured row length not above the row
    (a block measured at 2048 tokens divides 4096's rows as well), or splash's defaults
    where there is none (another head width, a shorter row)."""
    measured = [T for T, widths in SPLASH_BLOCKS.items() if T <= seq_len and head_dim in widths]
    if not measured:
        return dict(SPLASH_DEFAULT_BLOCKS)
    return dict(SPLASH_BLOCKS[max(measured)][head_dim])


def splash_table_digest() -> str:
    """The first 16 hex digits of the sha256 of :data:`SPLASH_BLOCKS` and its defaults
    (canonical JSON): what a TPU recipe with splash attention records
    (``model.splash_table``), so its computation digest changes with the table."""
    import hashlib
    import json

    table = {str(T): {str(K): sizes for K, sizes in w.items()} for T, w in SPLASH_BLOCKS.items()}
    text = json.dumps(
        {"default": SPLASH_DEFAULT_BLOCKS, "measured": table}, sort_keys=True, separators=(",", ":")
    )
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def splash_blocks(seq_len: int, blocks: dict | None = None, head_dim: int | None = None) -> dict:
    """Splash's block sizes for rows of ``seq_len`` tokens (a multiple of
    :data:`SPLASH_LANES`) of heads ``head_dim`` wide: the table's
    (:func:`splash_table_blocks`), each of ``blocks`` overriding by field name, each lowered
    to the largest multiple of the lanes that divides the row (a compute block: its block)."""
    sizes = {**splash_table_blocks(seq_len, head_dim), **(blocks or {})}

    def fit(size: int, whole: int) -> int:
        best = SPLASH_LANES
        for block in range(SPLASH_LANES, min(size, whole) + 1, SPLASH_LANES):
            if whole % block == 0:
                best = block
        return best

    fitted = {name: fit(size, seq_len) for name, size in sizes.items()}
    for compute, whole in (
        ("block_kv_compute", "block_kv"),
        ("block_kv_dkv_compute", "block_kv_dkv"),
    ):
        fitted[compute] = fit(sizes[compute], fitted[whole])
    return fitted
