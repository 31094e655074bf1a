"""Time to first update of a packed-sft attempt: cold vs. with the persistent compilation cache.

Runs the demo recipe three times through the real worker (each a crash after a few
updates, so it stays short) and reads the figures from the events:

1. a fresh attempt with an empty cache directory (cold compile, fills the cache);
2. a resumed attempt with the same cache (warm);
3. a resumed attempt without any persistent cache (cold again, for comparison).

Prints ``compiled.seconds`` and (first ``update`` − ``attempt_started``) for each.

    uv run python benchmarks/compile_cache.py [--recipe config/recipes/sft-demo.yaml]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path


def _events(attempt: Path) -> list[dict]:
    return [json.loads(line) for line in (attempt / "events.jsonl").read_text().splitlines()]


def _figures(attempt: Path) -> tuple[float, float]:
    events = _events(attempt)
    started = next(e["mono"] for e in events if e["type"] == "attempt_started")
    compiled = next(e["seconds"] for e in events if e["type"] == "compiled")
    first = next(e["mono"] for e in events if e["type"] == "update")
    return compiled, first - started


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", type=Path, default=Path("config/recipes/sft-demo.yaml"))
    parser.add_argument("--input-root", type=Path, default=Path("data"))
    args = parser.parse_args()
    from minifield.supervision import accelerator

    # only a worker opens the accelerator: this parent runs JAX on the CPU, if at all
    # (minifield.supervision.accelerator); the processes it measures get worker_env
    accelerator.keep_off()
    with tempfile.TemporaryDirectory() as tmp:
        out, cache = Path(tmp) / "out", Path(tmp) / "jax-cache"

        def attempt(name: str, *extra: str) -> Path:
            command = [
                sys.executable,
                "-m",
                "minifield.worker",
                "--job",
                str(args.recipe),
                "--input-root",
                str(args.input_root),
                "--output-root",
                str(out),
                "--attempt-id",
                name,
                *extra,
            ]
            subprocess.run(command, capture_output=True, check=False, env=accelerator.worker_env())
            return next(out.glob(f"*/{name}"))

        cold = attempt("cold", "--compilation-cache", str(cache), "--fail-after-step", "5")
        warm = attempt(
            "warm",
            "--compilation-cache",
            str(cache),
            "--resume-from",
            str(cold),
            "--fail-after-step",
            "10",
        )
        none = attempt("nocache", "--resume-from", str(warm), "--fail-after-step", "15")
        print(f"{'attempt':<32} {'compiled s':>10} {'first update s':>15}")
        for label, directory in (
            ("fresh, empty cache (cold)", cold),
            ("resumed, warm cache", warm),
            ("resumed, no persistent cache", none),
        ):
            compiled, first = _figures(directory)
            print(f"{label:<32} {compiled:>10.2f} {first:>15.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
