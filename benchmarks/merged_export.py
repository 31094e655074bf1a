"""A LoRA run's merged export written on the host: the writer as it is against the writer as it
was, in the same run, on the same base and adapters.

The base: random BF16 matrices in HF's ``[out, in]`` layout, held as a run's prepared arrays
hold them (``stored_base.to_arrays``); the adapters: rank ``--rank`` on every linear layer.
The export: ``hf.checkpoint.write`` of :class:`minifield.training.host_merge.HostMerge`'s
tensors in BF16, shards of ``--shard`` bytes, into a temporary directory deleted after.

- now: each tensor merged in its stored layout (no copy into ``[in, out]`` and back), a shard's
  tensors converted side by side by the reading pool's threads, each written into its file as
  soon as it is converted (the file laid out first), never a shard held;
- before (the baseline, its code repeated here): each tensor widened into ``[in, out]``, merged
  there, transposed back and converted by the writer, one tensor after another, each shard
  serialised in memory and written before the next is converted.

Both write the same bytes (checked every round). Prints the median seconds and MB/s of each,
the ratio before ÷ now, and the most memory each held (``tracemalloc``'s peak, a round of its
own: NumPy's arrays and the serialised bytes, not JAX's buffers) beside the largest shard.

    uv run python benchmarks/merged_export.py --layers 4 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
import tracemalloc
from pathlib import Path

import ml_dtypes
import numpy as np

from minifield.hf import checkpoint as hf_checkpoint
from minifield.hf import stored_base
from minifield.models import llama
from minifield.models.families import param_shape
from minifield.training import host_merge, lora

TARGETS = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")


def inputs(args):
    """``(cfg, arrays, adapters, settings)``: the base as prepared arrays, the adapters."""
    cfg = llama.LlamaConfig(vocab_size=args.vocab, d_model=args.d_model, n_layers=args.layers,
                            n_heads=args.d_model // 128, n_kv_heads=max(1, args.d_model // 512),
                            d_ff=args.d_ff, max_len=64)  # fmt: skip
    rng = np.random.default_rng(0)
    params, layout, adapters = {}, {}, {"blocks": {}}
    for internal, transpose, _ in hf_checkpoint.expected_tensors(cfg).values():
        shape = param_shape(cfg, internal)
        stored = shape[::-1] if transpose else shape
        value = rng.standard_normal(stored, np.float32) * 0.02
        params[internal], layout[internal] = value.astype(ml_dtypes.bfloat16), bool(transpose)
        *parents, leaf = internal.split("/")
        if leaf in TARGETS:
            node = adapters["blocks"].setdefault(parents[1], {}).setdefault(parents[2], {})
            node[leaf] = {"a": rng.standard_normal((shape[0], args.rank), np.float32) * 0.01,
                          "b": rng.standard_normal((args.rank, shape[1]), np.float32) * 0.01}  # fmt: skip
    arrays = stored_base.to_arrays(stored_base.nest(params.items()), layout)
    settings = lora.LoraSettings(args.rank, 2.0 * args.rank, TARGETS, "bfloat16")
    return cfg, arrays, adapters, settings


class Before(host_merge.HostMerge):
    """The merge as it was: each tensor widened into ``[in, out]`` and merged there."""

    def value(self, tensor):
        import jax

        path = tensor.path
        stored = self.stored[path]
        w = stored.T if path in self.out_in else stored
        w = np.asarray(w).astype(ml_dtypes.bfloat16).astype(np.float32)
        if path not in self.pairs:
            return w
        op, device = self._ops[False]
        merged = op(
            *(jax.device_put(np.asarray(x, np.float32), device) for x in (w, *self.pairs[path]))
        )
        return np.asarray(merged)


def _write_files_before(directory, planned, expected, value_of, dtype: str) -> None:
    """The writer's loop as it was: one tensor after another, each shard written in turn."""
    from safetensors.numpy import save

    from minifield import atomic
    from minifield.hf.parallel_files import stored_type

    stored_dtype = stored_type(dtype)

    for file, names in planned.files.items():
        tensors = {}
        for name in names:
            internal, transpose, _ = expected[name]
            value = value_of(internal)
            tensors[name] = np.ascontiguousarray(value.T if transpose else value).astype(
                stored_dtype
            )
        atomic.write_bytes(directory / file, save(tensors, metadata={"format": "pt"}))


def one(directory: Path, cfg, merge, shard: int, traced: bool = False) -> float:
    """Seconds of one export (``traced``: the peak bytes ``tracemalloc`` saw instead)."""
    if traced:
        tracemalloc.start()
    started = time.perf_counter()
    try:
        hf_checkpoint.write(
            directory, cfg, merge.params, "bfloat16", max_shard_size=shard, fetch=merge.value
        )
        return tracemalloc.get_traced_memory()[1] if traced else time.perf_counter() - started
    finally:
        tracemalloc.stop()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--d-model", type=int, default=2048)
    parser.add_argument("--d-ff", type=int, default=5632)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--shard", type=int, default=500_000_000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    cfg, arrays, adapters, settings = inputs(args)
    now, before = (
        host_merge.HostMerge(arrays, adapters, settings),
        Before(arrays, adapters, settings),
    )
    seconds: dict[str, list[float]] = {"before": [], "now": []}
    root = Path(tempfile.mkdtemp(prefix="merged-export-"))
    original = hf_checkpoint._write_files
    try:
        for _ in range(args.rounds):
            shutil.rmtree(root / "now", ignore_errors=True)
            shutil.rmtree(root / "before", ignore_errors=True)
            seconds["now"].append(one(root / "now", cfg, now, args.shard))
            hf_checkpoint._write_files = _write_files_before
            try:
                seconds["before"].append(one(root / "before", cfg, before, args.shard))
            finally:
                hf_checkpoint._write_files = original
            for path in sorted((root / "before").iterdir()):
                if path.read_bytes() != (root / "now" / path.name).read_bytes():
                    raise SystemExit(f"{path.name}: the two writers' bytes differ")
        size = sum(p.stat().st_size for p in (root / "now").iterdir())
        largest = max(p.stat().st_size for p in (root / "now").glob("*.safetensors"))
        peaks = {}
        for name, merge in (("now", now), ("before", before)):
            shutil.rmtree(root / name)
            if name == "before":
                hf_checkpoint._write_files = _write_files_before
            try:
                peaks[name] = one(root / name, cfg, merge, args.shard, traced=True)
            finally:
                hf_checkpoint._write_files = original
    finally:
        shutil.rmtree(root, ignore_errors=True)
    median = {k: statistics.median(v) for k, v in seconds.items()}
    print(json.dumps({"export_bytes": size, "rounds": args.rounds,
                      "seconds": {k: [round(s, 3) for s in v] for k, v in seconds.items()},
                      "mb_per_s": {k: round(size / 1e6 / s, 1) for k, s in median.items()},
                      "before_over_now": round(median["before"] / median["now"], 2),
                      "largest_shard_mb": round(largest / 1e6, 1),
                      "peak_traced_mb": {k: round(v / 1e6, 1) for k, v in peaks.items()}},
                     indent=1))  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
