"""Loading a large HF safetensors checkpoint: time vs reading its bytes, and peak memory.

Writes a random checkpoint of Llama-3.2-1B's shapes (``--shape 1b``: d2048, 16 layers, GQA
32/8, SwiGLU 8192, vocabulary 128256, tied embeddings: 1.24 B parameters, a 2.5 GB BF16
``model.safetensors``; ``--shape small`` for a quick look) into a temporary directory,
deleted at the end, then measures, each in a fresh subprocess so one measurement's memory
and caches do not leak into the next (the file is read once first, so every side finds it
in the page cache), interleaved round by round:

- **read**: the file's bytes read into memory (``readinto`` a preallocated buffer, 16 MiB
  chunks): the floor any loader has to pay;
- **load**: ``hf_checkpoint.load`` (headers checked, tensors converted to the FP32 master
  parameters as JAX arrays), its time and the peak resident memory it adds over the
  process's resident memory just before (``ru_maxrss`` after minus RSS before), against the
  FP32 parameters' size;
- **no transpose**: the same conversion of every tensor (``hf_tensors.read_fp32``,
  finite check, ``device_put``) with no transpose at all — what a load would cost if the
  parameters kept HF's ``[out, in]`` layout: the bound for that layout change;
- **convert only**: the BF16→FP32 widening of the whole file's tensors in memory, from the
  page cache to fresh FP32 arrays, nothing else (the least a BF16→FP32 load does).

Goals (issue 21, item 4): load ≤ 1.3 × read; peak added RSS ≤ 1.2 × the FP32 weights.

    uv run --locked python benchmarks/hf_load.py [--shape 1b|small] [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

SHAPES = {
    # Llama-3.2-1B's config.json (the fields that set tensor shapes)
    "1b": {"hidden": 2048, "ffn": 8192, "layers": 16, "heads": 32, "kv": 8, "vocab": 128256},
    "small": {"hidden": 1024, "ffn": 2816, "layers": 4, "heads": 16, "kv": 4, "vocab": 32000},
}

READ = """
import json, os, sys, time
path = sys.argv[1] + "/model.safetensors"
size = os.path.getsize(path)
buffer = bytearray(size)
view = memoryview(buffer)
start = time.perf_counter()
with open(path, "rb", buffering=0) as f:
    done = 0
    while done < size:
        done += f.readinto(view[done : done + (16 << 20)])
print(json.dumps({"seconds": time.perf_counter() - start, "bytes": done}))
"""

PRELUDE = """
import json, resource, sys, time
import jax, jax.numpy as jnp, numpy as np
from minifield.strategies.packed_sft import hf_checkpoint, hf_tensors
jnp.zeros(1).block_until_ready()  # the backend up before the baseline
def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096
def done(start, before, **extra):
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({"seconds": seconds, "rss_before": before, "peak": peak, **extra}))
before = rss()
start = time.perf_counter()
"""

LOAD = (
    PRELUDE
    + """
cfg, params = hf_checkpoint.load(sys.argv[1])
jax.block_until_ready(params)
done(start, before, fp32_bytes=hf_checkpoint.fp32_bytes(cfg))
"""
)

#: every tensor through the loader's own conversion, none transposed
NO_TRANSPOSE = (
    PRELUDE
    + """
from pathlib import Path
path = Path(sys.argv[1]) / hf_checkpoint.SINGLE_FILE
offsets = hf_tensors.data_offsets(path)
with open(path, "rb") as f:
    header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
params = {}
with hf_tensors.Source(path) as source:
    for name, (first, end, _) in offsets.items():
        value = hf_tensors.read_fp32(
            source, first, end, tuple(header[name]["shape"]),
            hf_tensors.source_dtype(name, offsets), False, name,
        )
        params[name] = jax.device_put(value, may_alias=True)
jax.block_until_ready(params)
done(start, before)
"""
)

#: the widening alone: every tensor's BF16 bytes (page cache, memory-mapped) to FP32
CONVERT = (
    PRELUDE
    + """
import mmap
import ml_dtypes
from pathlib import Path
path = Path(sys.argv[1]) / hf_checkpoint.SINGLE_FILE
offsets = hf_tensors.data_offsets(path)
out = []
with open(path, "rb") as f:
    mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    for name, (first, end, _) in offsets.items():
        source = np.frombuffer(mapped, ml_dtypes.bfloat16, (end - first) // 2, first)
        out.append(source.astype(np.float32))
        del source
    mapped.close()
done(start, before)
"""
)


def write_checkpoint(directory: Path, shape: dict) -> Path:
    """A random BF16 checkpoint with PyTorch names, written tensor by tensor (random finite
    values — the exponent's top bit cleared —: only sizes matter here)."""
    import numpy as np

    hf = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": shape["vocab"],
        "hidden_size": shape["hidden"],
        "intermediate_size": shape["ffn"],
        "num_hidden_layers": shape["layers"],
        "num_attention_heads": shape["heads"],
        "num_key_value_heads": shape["kv"],
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "tie_word_embeddings": True,
        "torch_dtype": "bfloat16",
    }
    directory.mkdir(parents=True)
    (directory / "config.json").write_text(json.dumps(hf))
    sys.path.insert(0, str(ROOT / "src"))
    from minifield.strategies.packed_sft import hf_checkpoint

    cfg = hf_checkpoint.config_from_hf(hf)
    tensors = {name: s for name, (_, _, s) in hf_checkpoint.expected_tensors(cfg).items()}
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, dims in tensors.items():
        size = 2 * int(np.prod(dims))
        header[name] = {
            "dtype": "BF16",
            "shape": list(dims),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    encoded = json.dumps(header).encode()
    encoded += b" " * (-len(encoded) % 8)
    rng = np.random.default_rng(0)
    path = directory / hf_checkpoint.SINGLE_FILE
    with open(path, "wb") as f:
        f.write(len(encoded).to_bytes(8, "little") + encoded)
        for dims in tensors.values():
            bits = rng.integers(0, 1 << 16, int(np.prod(dims)), dtype=np.uint16)
            f.write((bits & 0xBFFF).tobytes())
    return path


def _measure(script: str, argument: Path) -> dict:
    proc = subprocess.run(
        [sys.executable, "-c", script, str(argument)],
        capture_output=True,
        text=True,
        check=False,
        cwd=ROOT,
    )
    if proc.returncode != 0:
        raise SystemExit(f"measurement failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="1b")
    parser.add_argument("--rounds", type=int, default=2, help="median of N for each time")
    parser.add_argument("--dir", type=Path, default=None, help="where the checkpoint is written")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    shape = SHAPES[args.shape]
    sides = {"read": READ, "load": LOAD, "no_transpose": NO_TRANSPOSE, "convert": CONVERT}
    with tempfile.TemporaryDirectory(prefix="minifield-hf-load-", dir=args.dir) as tmp:
        directory = Path(tmp) / "model"
        weights = write_checkpoint(directory, shape)
        with open(weights, "rb") as f:  # into the page cache for every side
            while f.read(64 << 20):
                pass
        runs = {name: [] for name in sides}
        for _ in range(args.rounds):
            for name, script in sides.items():
                runs[name].append(_measure(script, directory))
        file_bytes = weights.stat().st_size
    seconds = {name: statistics.median(r["seconds"] for r in rows) for name, rows in runs.items()}
    fp32 = runs["load"][0]["fp32_bytes"]
    added = {
        name: max(r["peak"] - r["rss_before"] for r in rows)
        for name, rows in runs.items()
        if name != "read"
    }
    result = {
        "shape": {"name": args.shape, **shape},
        "file_bytes": file_bytes,
        "fp32_bytes": fp32,
        "rounds": args.rounds,
        "seconds": seconds,
        "over_read": {name: s / seconds["read"] for name, s in seconds.items()},
        "peak_added_over_fp32": {name: a / fp32 for name, a in added.items()},
    }
    print(
        f"BF16 file {file_bytes / 1e9:.2f} GB ({args.shape}: {shape}), FP32 weights "
        f"{fp32 / 1e9:.2f} GB, median of {args.rounds}"
    )
    for name in sides:
        peak = result["peak_added_over_fp32"].get(name)
        print(
            f"  {name:13s} {seconds[name]:7.3f} s = {result['over_read'][name]:5.2f}x the read"
            + (f"; peak added RSS {peak:.2f}x the FP32 weights" if peak is not None else "")
            + {"load": " (goals <= 1.3x, <= 1.2x)"}.get(name, "")
        )
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
