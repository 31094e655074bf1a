"""The per-update state hash as the worker computes it now, against the previous release's
way, same run.

hashlib releases the GIL only for calls of at least 2,048 bytes, so an array whose pieces
are smaller is hashed holding it, and threads hashing such arrays take turns at the GIL.
``pieces.host_digests`` now gives the threads only arrays of large pieces
(``pieces.on_threads``) and reorders a block of small pieces up to ``pieces.WHOLE_COPY`` by one
copy (it copied a row of pieces at a time, whatever the size). For the complete training
state (parameters + AdamW moments + RNG, step, cursor) of packed-sft models of three sizes —
d_model 64 × 2 layers (the default demo's size, 1.5 MB), 128 × 2, and 256 × 4 (the 39 MB
state of docs/training-loop.md) — on the host, round by round and interleaved:

- **before**: every array given to the threads, blocks reordered a row at a time
  (``WHOLE_COPY`` 0);
- **now**: ``pieces.host_digests`` (what the worker runs for every hashed update).

Checks both give the same digests, and prints the median process CPU and wall per hash of
each and now ÷ before. Run: ``uv run python benchmarks/state_hash_threads.py
[--rounds 15]``.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from checkpoint_commit import _state  # noqa: E402
from state_hash_pieces import report, timed  # noqa: E402

from minifield.state import pieces  # noqa: E402
from minifield.state.arrays import named_arrays  # noqa: E402

SIZES = ((64, 2), (128, 2), (256, 4))


def before(arrays: dict) -> dict[str, str]:
    names = sorted(arrays)
    whole_copy, pieces.WHOLE_COPY = pieces.WHOLE_COPY, 0
    try:
        digests = pieces.on_threads(names, lambda n: pieces.array_digest(arrays[n]), lambda n: True)
    finally:
        pieces.WHOLE_COPY = whole_copy
    return dict(zip(names, digests, strict=True))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    for d_model, layers in SIZES:
        _, _, state = _state(d_model, layers)
        arrays = {name: value.copy() for name, value in named_arrays(state).items()}
        assert before(arrays) == pieces.host_digests(arrays)
        size = sum(a.nbytes for a in arrays.values())
        count = sum(math.prod(pieces.piece_grid(a.shape)) for a in arrays.values())
        repeat = max(1, int(2e6 // count))
        old, new = [], []
        for _ in range(args.rounds):
            old.append(timed(lambda a=arrays: before(a), repeat))
            new.append(timed(lambda a=arrays: pieces.host_digests(a), repeat))
        print(
            f"d_model {d_model} x {layers} layers: {size / 1e6:.1f} MB, "
            f"{len(arrays)} arrays, {count} pieces"
        )
        report(("before", old), ("now", new), indent="  ")


if __name__ == "__main__":
    main()
