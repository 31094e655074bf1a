"""Writing an HF export in shards: the writer's peak memory and time against one file.

``hf.checkpoint.write`` of random FP32 parameters (numpy, built from the tensor table's
shapes; ``--shape small``: d128, 4 layers, 2.6 MB; ``--shape medium``: d512, 8 layers, GQA
8/2, SwiGLU 1536, vocabulary 32000, 228 MB) into a temporary directory, deleted at the end:
once as the single ``model.safetensors`` (the baseline, ``max_shard_size`` None) and once per
``--shard`` size, interleaved round by round (``--rounds``). Memory: ``tracemalloc``'s peak
of what the writer allocates beyond the parameters it is given (numpy and the serialised
bytes are traced), as a ratio to the FP32 model; time: the whole write, as a ratio to the
single file's in the same round (median over the rounds).

``--by-slices``: each shard size also through the writer a multi-process attempt uses
(``group=`` one process's ``Group``: ``hf.parallel_files``, each tensor converted by itself and
``pwrite`` into files laid out first), measured the same way beside the whole-tensor writer.

    uv run python benchmarks/export_shards.py --shape small --shard 1000000 150000
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
import tracemalloc
from pathlib import Path

import numpy as np

from minifield.hf import checkpoint as hf_checkpoint
from minifield.models import llama
from minifield.models.expert_slots import put
from minifield.models.families import param_shape

SHAPES = {
    "small": {"vocab_size": 260, "d_model": 128, "n_layers": 4, "n_heads": 4, "n_kv_heads": 2, "d_ff": 256},
    "medium": {"vocab_size": 32000, "d_model": 512, "n_layers": 8, "n_heads": 8, "n_kv_heads": 2, "d_ff": 1536},
}  # fmt: skip


def parameters(shape: str):
    cfg = llama.LlamaConfig(**SHAPES[shape], max_len=64)
    rng = np.random.default_rng(0)
    params: dict = {"blocks": {}}
    for internal, _, _ in hf_checkpoint.expected_tensors(cfg).values():
        value = rng.standard_normal(param_shape(cfg, internal)).astype(np.float32)
        put(params, internal, value, cfg.n_experts)
    return cfg, params


def measure(directory: Path, cfg, params, size, group=None) -> tuple[float, int, int]:
    """``(seconds, peak bytes traced, safetensors files)`` of one write."""
    tracemalloc.start()
    started = time.perf_counter()
    try:
        hf_checkpoint.write(directory, cfg, params, max_shard_size=size, group=group)
        seconds = time.perf_counter() - started
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    return seconds, peak, len(list(directory.glob("*.safetensors")))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="small")
    parser.add_argument("--shard", type=int, nargs="+", default=[1_000_000, 150_000])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--by-slices", action="store_true")
    args = parser.parse_args()
    cfg, params = parameters(args.shape)
    model_bytes = 4 * sum(v.size for v in _leaves(params))
    sizes = [None, *args.shard]
    if args.by_slices:
        sizes += [("slices", size) for size in args.shard]
    seconds: dict = {s: [] for s in sizes}
    peaks: dict = {s: [] for s in sizes}
    files: dict = {}
    with tempfile.TemporaryDirectory(prefix="minifield-shards-") as tmp:
        for round_ in range(args.rounds):
            for size in sizes:
                if isinstance(size, tuple):
                    directory = Path(tmp) / f"{round_}-{size[1]}-slices"
                    from minifield.supervision.distributed import Group

                    spent, peak, count = measure(directory, cfg, params, size[1], Group())
                else:
                    directory = Path(tmp) / f"{round_}-{size}"
                    spent, peak, count = measure(directory, cfg, params, size)
                seconds[size].append(spent)
                peaks[size].append(peak)
                files[size] = count
    base_time = statistics.median(seconds[None])
    print(f"shape {args.shape}: FP32 model {model_bytes / 1e6:.2f} MB, {args.rounds} rounds")
    for size in sizes:
        label = "one file" if size is None else f"shards of {size} B"
        if isinstance(size, tuple):
            label = f"by slices, {size[1]} B"
        peak = max(peaks[size])
        ratio = statistics.median(seconds[size]) / base_time
        print(
            f"{label:>22}: {files[size]:3d} files, writer peak {peak / 1e6:8.2f} MB "
            f"({peak / model_bytes:.2f}x the model), time {ratio:.2f}x one file's"
        )


def _leaves(tree):
    for value in tree.values():
        if isinstance(value, dict):
            yield from _leaves(value)
        else:
            yield value


if __name__ == "__main__":
    main()
