"""State-hash version 3 (pieces) against version 2 (one sha256 per array), same run.

For the complete training state (parameters + AdamW moments + RNG, step, cursor) of a real
packed-sft model (``init_train_state``, d_model 256, 4 layers: the 39 MB state of
docs/training-loop.md), already on the host, round by round and interleaved:

- **version 2**: ``array_digests(arrays, version=2)``, each array's bytes hashed once;
- **version 3**: ``array_digests(arrays)``, each array hashed in its canonical pieces
  (``state/pieces.py``), the same bytes plus a sha256 per piece and, where pieces are cut
  along more than the first axis, one reordering copy.

Prints the median seconds of each (process CPU and wall) and version 3 ÷ version 2. Run:
``uv run python benchmarks/state_hash_pieces.py [--rounds 7]``.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_train import TRAINING  # noqa: E402
from checkpoint_commit import _state  # noqa: E402

from minifield.state import pieces  # noqa: E402
from minifield.state.arrays import array_digests, named_arrays  # noqa: E402

del TRAINING  # imported for the same settings as checkpoint_commit (its _state uses them)


def timed(function, repeat: int = 1) -> tuple[float, float]:
    """Process CPU and wall seconds of one call of ``function`` (the mean of ``repeat``)."""
    cpu, wall = time.process_time(), time.perf_counter()
    for _ in range(repeat):
        function()
    return (time.process_time() - cpu) / repeat, (time.perf_counter() - wall) / repeat


def report(baseline: tuple[str, list], other: tuple[str, list], indent: str = "") -> None:
    """The median CPU and wall of each ``(name, rounds)`` and ``other`` ÷ ``baseline``."""
    for name, rounds in (baseline, other):
        cpu = statistics.median(r[0] for r in rounds)
        wall = statistics.median(r[1] for r in rounds)
        print(f"{indent}{name:12s} CPU {cpu * 1e3:7.2f} ms  wall {wall * 1e3:7.2f} ms")
    ratio = [
        statistics.median(r[i] for r in other[1]) / statistics.median(r[i] for r in baseline[1])
        for i in (0, 1)
    ]
    print(f"{indent}{other[0]} / {baseline[0]}: CPU {ratio[0]:.2f}  wall {ratio[1]:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    _, _, state = _state(256, 4)
    arrays = {name: value.copy() for name, value in named_arrays(state).items()}
    size = sum(a.nbytes for a in arrays.values())
    count = sum(math.prod(pieces.piece_grid(a.shape)) for a in arrays.values())
    v2, v3 = [], []
    for _ in range(args.rounds):
        v2.append(timed(lambda: array_digests(arrays, version=2)))
        v3.append(timed(lambda: array_digests(arrays)))
    print(f"state: {size / 1e6:.1f} MB, {len(arrays)} arrays, {count} pieces")
    report(("version 2", v2), ("version 3", v3))


if __name__ == "__main__":
    main()
