"""Loading a large HF safetensors checkpoint: time vs reading its bytes, and peak memory.

Writes a random Llama-architecture checkpoint of at least 500 MB (F32, and a BF16 copy of the
same shapes) into a temporary directory, then measures, each in a fresh subprocess so one
measurement's memory and caches do not leak into the next (the file is read once first so
both sides find it in the page cache):

- **read**: the file's bytes read into memory (``readinto`` a preallocated buffer, 16 MiB
  chunks): the floor any loader has to pay;
- **load**: ``hf_checkpoint.load`` (headers checked, tensors converted to the FP32 master
  parameters as JAX arrays), the time and the peak resident memory it adds over the process's
  resident memory just before (``ru_maxrss`` after minus RSS before), against the FP32
  parameters' size.

Goals (issue 12): load time ≤ 1.3 × read time; peak ≤ ~1.3 × the FP32 weights.

    uv run --locked python benchmarks/hf_load.py [--hidden 1024 --layers 8 --vocab 32000]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

READ = """
import json, os, sys, time
path = sys.argv[1]
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

LOAD = """
import json, resource, sys, time
import jax, jax.numpy as jnp, numpy as np
from minifield.strategies.packed_sft import hf_checkpoint
jnp.zeros(1).block_until_ready()  # the backend up before the baseline
def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096
before = rss()
start = time.perf_counter()
cfg, params = hf_checkpoint.load(sys.argv[1])
jax.block_until_ready(params)
seconds = time.perf_counter() - start
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(json.dumps({"seconds": seconds, "rss_before": before, "peak": peak, "rss_after": rss(),
                  "fp32_bytes": hf_checkpoint.fp32_bytes(cfg)}))
"""


def write_checkpoint(directory: Path, hidden: int, layers: int, vocab: int, dtype: str) -> Path:
    """A random Llama checkpoint with PyTorch names (random values: only sizes matter here)."""
    import ml_dtypes
    import numpy as np
    from safetensors.numpy import save_file

    heads, kv_heads = hidden // 64, max(1, hidden // 256)
    hf = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": int(hidden * 2.75),
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "torch_dtype": dtype,
    }
    directory.mkdir(parents=True)
    (directory / "config.json").write_text(json.dumps(hf))
    sys.path.insert(0, str(ROOT / "src"))
    from minifield.strategies.packed_sft import hf_checkpoint

    cfg = hf_checkpoint.config_from_hf(hf)
    stored = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16}[dtype]
    rng = np.random.default_rng(0)
    tensors = {
        name: rng.standard_normal(shape, dtype=np.float32).astype(stored)
        for name, (_, _, shape) in hf_checkpoint.expected_tensors(cfg).items()
    }
    path = directory / hf_checkpoint.SINGLE_FILE
    save_file(tensors, str(path), metadata={"format": "pt"})
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
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--repeats", type=int, default=3, help="best of N for each time")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="minifield-hf-load-") as tmp:
        for dtype in ("float32", "bfloat16"):
            directory = Path(tmp) / dtype
            weights = write_checkpoint(directory, args.hidden, args.layers, args.vocab, dtype)
            weights.read_bytes()  # into the page cache for both sides
            reads = [_measure(READ, weights) for _ in range(args.repeats)]
            loads = [_measure(LOAD, directory) for _ in range(args.repeats)]
            read = min(r["seconds"] for r in reads)
            load = min(r["seconds"] for r in loads)
            fp32 = loads[0]["fp32_bytes"]
            added = max(r["peak"] - r["rss_before"] for r in loads)
            print(
                f"{dtype} file {weights.stat().st_size / 1e6:.0f} MB "
                f"(d{args.hidden}, {args.layers} layers, vocab {args.vocab}), "
                f"FP32 weights {fp32 / 1e6:.0f} MB"
            )
            print(f"  read the bytes   {read:.3f} s (best of {args.repeats})")
            print(f"  hf_checkpoint.load {load:.3f} s -> {load / read:.2f}x the read (goal <= 1.3)")
            print(
                f"  peak added RSS   {added / 1e6:.0f} MB -> {added / fp32:.2f}x the FP32 weights "
                f"(goal <= ~1.3); held after load {(loads[0]['rss_after'] - loads[0]['rss_before']) / 1e6:.0f} MB"
            )
            sys.stdout.flush()
            weights.unlink()


if __name__ == "__main__":
    main()
