"""Loading a large HF safetensors checkpoint: time vs reading its bytes, and peak memory.

Writes a random checkpoint of Llama-3.2-1B's shapes (``--shape 1b``: d2048, 16 layers, GQA
32/8, SwiGLU 8192, vocabulary 128256, tied embeddings: 1.24 B parameters, a 2.5 GB BF16
``model.safetensors``; ``--shape small`` for a quick look) into a temporary directory,
deleted at the end, then measures, each in a fresh subprocess so one measurement's memory
and caches do not leak into the next (the file is read once first, so every side finds it
in the page cache), interleaved round by round:

- **read**: the file's bytes read into memory (``readinto`` a preallocated buffer, 16 MiB
  chunks): the floor any loader has to pay;
- **read fresh**: the same into memory allocated inside the timing (``np.empty``): the
  floor for a loader whose arrays are new memory (page faults included);
- **load**: ``hf_checkpoint.load`` (headers checked, tensors converted to the FP32 master
  parameters as JAX arrays), its time and the peak resident memory it adds over the
  process's resident memory just before (``ru_maxrss`` after minus RSS before), against the
  FP32 parameters' size;
- **no transpose**: the same conversion of every tensor (``hf_tensors.read_fp32``,
  finite check, ``device_put``) with no transpose at all — what a load would cost if the
  parameters kept HF's ``[out, in]`` layout: the bound for that layout change;
- **convert only**: the BF16→FP32 widening of the whole file's tensors in memory, from the
  page cache to fresh FP32 arrays, nothing else (the least a BF16→FP32 load does);
- **stored**: ``hf_checkpoint.load_stored`` (the same checks; every tensor in its own dtype
  and HF's layout, read straight into aligned buffers, finite-checked, ``device_put``):
  what the prepare stage of a LoRA recipe reads, with peak added RSS against the weights as
  loaded (the file's tensor bytes);
- **LoRA base load**: what a LoRA run does at its start with the base the prepare stage
  wrote (written once here, :func:`.stored_base.to_arrays` + ``examples.write``):
  ``examples.load`` (the sha256 of every prepared file checked against the manifest, the
  arrays memory-mapped) then :func:`.stored_base.on_device`; ``verify_seconds`` is the
  sha256 part.

- **load_model**, **full_start**, **export_load** (issue 33 item 8, :mod:`_hf_load_paths`):
  ``minifield.load_model`` on the HF directory; a full fine-tune's start from the prepared
  base (``examples.load`` with its sha256 checks, ``pinned_base.params_from_arrays``, the FP32
  masters put on the device as the step-0 state holds them); ``ExportedModel`` on an export
  of the directory (every listed file's sha256 checked, the weights read): each against
  **read_<side>**, a raw read of the very files it reads, in the same round.

Every side also records its process's CPU seconds (user + system), whose ratios hold whatever
share of the cores a loaded machine gives each process. ``--before SRC`` measures every loading
side a second time with the minifield under ``SRC`` (an older tree's ``src/``), interleaved in
the same rounds (``<side>@before``); ``--sides`` picks sides, ``--dtype F32`` writes an F32
file, ``--shape issue`` is issue 33's directory (d1024, 8 layers, vocabulary 32000, untied:
623 MB as F32).

Then **one LoRA update** on the stored base (rank 8 on ``q_proj``/``v_proj``, batch 1,
``--seq-len`` tokens, BF16 compute, base held BF16; compile excluded, median of 3), and the
same update on a base transposed beforehand: the difference is the per-step cost of making
``[in, out]`` matrices from the stored ``[out, in]`` ones inside the step.

Goals (issue 21, item 4; issue 33, item 8 for the three public loads): load ≤ 1.3 × read; peak
added RSS ≤ 1.2 × the weights as loaded (the FP32 loads: against their FP32 weights).

    uv run --locked python benchmarks/hf_load.py [--shape 1b|small|issue] [--dtype BF16|F32]
        [--rounds 2] [--seq-len 32] [--sides load_model,...] [--no-update] [--before SRC]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import _hf_load_paths as paths

from minifield.supervision import accelerator

ROOT = Path(__file__).resolve().parents[1]

SHAPES = {
    # Llama-3.2-1B's config.json (the fields that set tensor shapes)
    "1b": {"hidden": 2048, "ffn": 8192, "layers": 16, "heads": 32, "kv": 8, "vocab": 128256},
    "small": {"hidden": 1024, "ffn": 2816, "layers": 4, "heads": 16, "kv": 4, "vocab": 32000},
    # issue 33 item 8's directory: 623 MB as F32 (``--dtype F32``), untied head
    "issue": {"hidden": 1024, "ffn": 2816, "layers": 8, "heads": 16, "kv": 4, "vocab": 32000},
}
#: shapes whose head is its own matrix (``tie_word_embeddings`` false)
UNTIED = {"issue"}

READ = """
import json, os, resource, sys, time
path = sys.argv[1] + "/model.safetensors"
size = os.path.getsize(path)
buffer = bytearray(size)
view = memoryview(buffer)
usage = resource.getrusage(resource.RUSAGE_SELF)
cpu_before = usage.ru_utime + usage.ru_stime
start = time.perf_counter()
with open(path, "rb", buffering=0) as f:
    done = 0
    while done < size:
        done += f.readinto(view[done : done + (16 << 20)])
usage = resource.getrusage(resource.RUSAGE_SELF)
cpu = usage.ru_utime + usage.ru_stime - cpu_before
print(json.dumps({"seconds": time.perf_counter() - start, "cpu": cpu, "bytes": done}))
"""

#: the read into memory allocated inside the timing (a loader's arrays are fresh memory: its
#: page faults are part of any load, and ``read``'s buffer is zeroed before its clock starts)
READ_FRESH = (
    READ.replace(
        "buffer = bytearray(size)\nview = memoryview(buffer)\nusage",
        "usage",
    )
    .replace(
        "start = time.perf_counter()\nwith open",
        "start = time.perf_counter()\nbuffer = np.empty(size, np.uint8)\nview = memoryview(buffer)\n"
        "with open",
    )
    .replace(
        "import json, os, resource, sys, time",
        "import json, os, resource, sys, time\nimport numpy as np",
    )
)

PRELUDE = """
import json, resource, sys, time
import jax, jax.numpy as jnp, numpy as np
from minifield.hf import checkpoint as hf_checkpoint
from minifield.hf import tensors as hf_tensors
jnp.zeros(1).block_until_ready()  # the backend up before the baseline
def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096
def done(start, before, **extra):
    seconds = time.perf_counter() - start
    usage = resource.getrusage(resource.RUSAGE_SELF)
    peak = usage.ru_maxrss * 1024
    cpu = usage.ru_utime + usage.ru_stime - cpu_before
    print(json.dumps({"seconds": seconds, "cpu": cpu, "rss_before": before, "peak": peak, **extra}))
before = rss()
_usage = resource.getrusage(resource.RUSAGE_SELF)
cpu_before = _usage.ru_utime + _usage.ru_stime
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
            hf_tensors.source_dtype_of(offsets[name][2]), False, name,
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
from pathlib import Path
path = Path(sys.argv[1]) / hf_checkpoint.SINGLE_FILE
offsets = hf_tensors.data_offsets(path)
out = []
with open(path, "rb") as f:
    mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    for name, (first, end, kind) in offsets.items():
        dtype = hf_tensors.source_dtype_of(kind)
        source = np.frombuffer(mapped, dtype, (end - first) // dtype.itemsize, first)
        out.append(source.astype(np.float32, copy=True))
        del source
    mapped.close()
done(start, before)
"""
)


#: every tensor as stored (dtype, layout), on the device
STORED = (
    PRELUDE
    + """
cfg, params, _ = hf_checkpoint.load_stored(sys.argv[1])
params = jax.tree_util.tree_map(lambda a: jax.device_put(a, may_alias=True), params)
jax.block_until_ready(params)
done(start, before, stored_bytes=sum(a.nbytes for a in jax.tree_util.tree_leaves(params)))
"""
)

#: a LoRA run's start: the prepared base verified, memory-mapped, put on the device
LORA_BASE = (
    PRELUDE
    + """
from pathlib import Path
from minifield.inputs import examples
from minifield.hf import stored_base
arrays, _ = examples.load(Path(sys.argv[1]).parent / "prepared")
verified = time.perf_counter()
base = stored_base.on_device(arrays, "bfloat16")
jax.block_until_ready(base)
done(start, before, verify_seconds=verified - start)
"""
)

#: one LoRA update on the stored base, and on a base transposed beforehand
LORA_UPDATE = """
import json, statistics, sys, time
import jax, jax.numpy as jnp, numpy as np, optax
from minifield.hf import checkpoint as hf_checkpoint
from minifield.training import lora
from minifield.hf.stored_base import FrozenBase
from minifield.data.packing import Rows
seq_len = int(sys.argv[2])
cfg, params, layout = hf_checkpoint.load_stored(sys.argv[1], seq_len, "bfloat16")
out_in = frozenset(path for path, transposed in layout.items() if transposed)
base = FrozenBase(jax.tree_util.tree_map(jax.device_put, params), out_in, "bfloat16")
del params
settings = lora.LoraSettings(8, 16.0, ("q_proj", "v_proj"), "bfloat16")
optimizer = optax.adamw(1e-4)
step = jax.jit(lora.make_train_step(cfg, settings, optimizer), donate_argnums=(0,))
tokens = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (1, seq_len)), jnp.int32)
batch = Rows(tokens, jnp.ones_like(tokens), jnp.arange(seq_len, dtype=jnp.int32)[None],
             jnp.ones_like(tokens))
def timed(base):
    state = lora.init_state(cfg, settings, optimizer, 0, np.zeros(32, np.uint8))
    start = time.perf_counter()
    state, metrics = step(state, base, batch)
    jax.block_until_ready(state)
    compile_seconds = time.perf_counter() - start
    seconds = []
    for _ in range(3):
        start = time.perf_counter()
        state, metrics = step(state, base, batch)
        jax.block_until_ready(state)
        seconds.append(time.perf_counter() - start)
    return {"first": compile_seconds, "update": statistics.median(seconds), "loss": float(metrics["loss"])}
stored = timed(base)
# the same base already [in, out]: made on the device, the stored one released first
transposed = jax.jit(lambda b: b.model_params())(base)
del base
pre = timed(FrozenBase(transposed, frozenset(), "bfloat16"))
print(json.dumps({"stored": stored, "pre_transposed": pre}))
"""


def write_checkpoint(directory: Path, shape: dict, tied: bool = True, dtype: str = "BF16") -> Path:
    """A random BF16 (or F32) checkpoint with PyTorch names, written tensor by tensor (random
    finite values — the exponent's top bit cleared —: only sizes matter here)."""
    import numpy as np

    bits_type, finite_mask, item = {
        "BF16": (np.uint16, 0xBFFF, 2),
        "F32": (np.uint32, 0xBFFFFFFF, 4),
    }[dtype]

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
        "tie_word_embeddings": tied,
        "torch_dtype": {"BF16": "bfloat16", "F32": "float32"}[dtype],
    }
    directory.mkdir(parents=True)
    (directory / "config.json").write_text(json.dumps(hf))
    sys.path.insert(0, str(ROOT / "src"))
    from minifield.hf import checkpoint as hf_checkpoint

    cfg = hf_checkpoint.config_from_hf(hf)
    tensors = {name: s for name, (_, _, s) in hf_checkpoint.expected_tensors(cfg).items()}
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, dims in tensors.items():
        size = item * int(np.prod(dims))
        header[name] = {
            "dtype": dtype,
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
            bits = rng.integers(0, 1 << (8 * item), int(np.prod(dims)), dtype=bits_type)
            f.write((bits & finite_mask).tobytes())
    return path


def write_prepared(directory: Path) -> None:
    """The prepared base a LoRA recipe's prepare stage writes (``directory/../prepared``)."""
    from minifield.hf import checkpoint as hf_checkpoint
    from minifield.hf import stored_base
    from minifield.inputs import examples

    _, params, layout = hf_checkpoint.load_stored(directory)
    examples.write(directory.parent / "prepared", stored_base.to_arrays(params, layout), {}, "")


def _measure(script: str, argument: Path, *extra: str, src: Path | None = None) -> dict:
    env = accelerator.worker_env()  # the measured process may open the accelerator
    if src is not None:  # another tree's minifield (the code before a change)
        env["PYTHONPATH"] = str(src)
    proc = subprocess.run(
        [sys.executable, "-c", script, str(argument), *extra],
        capture_output=True,
        text=True,
        check=False,
        cwd=ROOT,
        env=env,
    )
    if proc.returncode != 0:
        raise SystemExit(f"measurement failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


#: each side's raw-read baseline (the same files read in the same round); the rest: ``read``
BASELINE = {name: f"read_{name}" for name in ("load_model", "full_start", "export_load")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="1b")
    parser.add_argument("--dtype", choices=("BF16", "F32"), default="BF16", help="stored dtype")
    parser.add_argument("--rounds", type=int, default=2, help="median of N for each time")
    parser.add_argument("--dir", type=Path, default=None, help="where the checkpoint is written")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--seq-len", type=int, default=32, help="tokens of the LoRA update")
    parser.add_argument("--sides", help="comma-separated sides to measure (default: all)")
    parser.add_argument("--no-update", action="store_true", help="skip the LoRA update")
    parser.add_argument(
        "--src", type=Path, help="measure the minifield under this src/ (e.g. an older tree's)"
    )
    parser.add_argument(
        "--before",
        type=Path,
        help="also measure every loading side with the minifield under this src/ (an older "
        "tree's), interleaved in the same rounds: the before/after of a change in one window",
    )
    args = parser.parse_args()
    # only a worker opens the accelerator: this parent runs JAX on the CPU, if at all
    # (minifield.supervision.accelerator); the processes it measures get worker_env
    accelerator.keep_off()
    shape = SHAPES[args.shape]
    sides = {
        "read": READ,
        "read_fresh": READ_FRESH,
        "load": LOAD,
        "no_transpose": NO_TRANSPOSE,
        "convert": CONVERT,
        "stored": STORED,
        "lora_base": LORA_BASE,
        "read_load_model": paths.READ_FILES,
        "load_model": PRELUDE + paths.LOAD_MODEL,
        "read_full_start": paths.READ_FILES,
        "full_start": PRELUDE + paths.FULL_START,
        "read_export_load": paths.READ_FILES,
        "export_load": PRELUDE + paths.EXPORT_LOAD,
    }
    if args.sides:
        wanted = set(args.sides.split(",")) | {"read"}
        wanted |= {BASELINE[name] for name in wanted if name in BASELINE}
        sides = {name: script for name, script in sides.items() if name in wanted}
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="minifield-hf-load-", dir=args.dir) as tmp:
        directory = Path(tmp) / "model"
        weights = write_checkpoint(directory, shape, args.shape not in UNTIED, args.dtype)
        paths.write_tokenizer(directory, 2048)
        write_prepared(directory)
        paths.write_export(directory)
        files = {f"read_{name}": found for name, found in paths.read_files(directory).items()}
        for path in {weights, *(Path(f) for found in files.values() for f in found)}:
            with open(path, "rb") as f:  # into the page cache for every side
                while f.read(64 << 20):
                    pass
        trees = [("", args.src)] + ([("@before", args.before)] if args.before else [])
        runs: dict[str, list] = {}
        for _ in range(args.rounds):
            for name, script in sides.items():
                for suffix, src in trees if not name.startswith("read") else trees[:1]:
                    row = _measure(script, directory, *files.get(name, ()), src=src)
                    runs.setdefault(name + suffix, []).append(row)
        update = None
        if not args.no_update:
            update = _measure(LORA_UPDATE, directory, str(args.seq_len), src=args.src)
        file_bytes = weights.stat().st_size
        from minifield.hf import checkpoint as hf_checkpoint

        fp32 = hf_checkpoint.fp32_bytes(
            hf_checkpoint.config_from_hf(json.loads((directory / "config.json").read_text()))
        )
    seconds = {name: statistics.median(r["seconds"] for r in rows) for name, rows in runs.items()}
    read_bytes = {name: rows[0]["bytes"] for name, rows in runs.items() if name.startswith("read")}
    # each side against the weights as it loads them: FP32 masters, or the bytes as stored
    stored = runs["stored"][0]["stored_bytes"] if "stored" in runs else file_bytes
    loaded_bytes = {"stored": stored, "lora_base": stored}
    added = {
        name: max(r["peak"] - r["rss_before"] for r in rows)
        / loaded_bytes.get(name.split("@")[0], fp32)
        for name, rows in runs.items()
        if not name.startswith("read")
    }
    over_read = {
        name: s / seconds[BASELINE.get(name.split("@")[0], "read")] for name, s in seconds.items()
    }
    # CPU seconds (user + system) of each side's process over its baseline's: what the work
    # costs, whatever share of the cores the machine gave it
    cpu = {name: statistics.median(r["cpu"] for r in rows) for name, rows in runs.items()}
    cpu_over_read = {
        name: c / cpu[BASELINE.get(name.split("@")[0], "read")] for name, c in cpu.items()
    }
    result = {
        "shape": {"name": args.shape, "dtype": args.dtype, **shape},
        "src": str(args.src) if args.src else None,
        "file_bytes": file_bytes,
        "read_bytes": read_bytes,
        "fp32_bytes": fp32,
        "stored_bytes": stored,
        "rounds": args.rounds,
        "seconds": seconds,
        "over_read": over_read,
        "cpu_seconds": cpu,
        "cpu_over_read": cpu_over_read,
        "peak_added_over_weights": added,
        "verify_seconds": {
            name: statistics.median(r["verify_seconds"] for r in runs[name])
            for name in runs
            if "verify_seconds" in runs[name][0]
        },
        "lora_update": update,
        "load_average": {"before": load_before, "after": os.getloadavg()},
    }
    if "read_fresh" in seconds:
        result["over_read_fresh"] = {n: s / seconds["read_fresh"] for n, s in seconds.items()}
    print(
        f"{args.dtype} file {file_bytes / 1e9:.2f} GB ({args.shape}: {shape}), FP32 weights "
        f"{fp32 / 1e9:.2f} GB, median of {args.rounds}; load average "
        f"{load_before[0]:.2f} before, {os.getloadavg()[0]:.2f} after"
        + (f"; minifield from {args.src}" if args.src else "")
    )
    goal = " (goals <= 1.3x, <= 1.2x)"
    goals = {"load_model": goal, "full_start": goal, "export_load": goal, "stored": goal}
    for name in runs:
        peak = added.get(name)
        baseline = BASELINE.get(name.split("@")[0], "read")
        print(
            f"  {name:23s} {seconds[name]:7.3f} s = {over_read[name]:5.2f}x {baseline} "
            f"(CPU {cpu[name]:6.3f} s = {cpu_over_read[name]:5.2f}x)"
            + (f"; peak added RSS {peak:.2f}x the weights as loaded" if peak is not None else "")
            + goals.get(name, "")
        )
    for name, verify in result["verify_seconds"].items():
        print(f"  ({name}: sha256 of the prepared files {verify:.3f} s)")
    for name, row in (update or {}).items():
        print(
            f"  LoRA update, base {name}: {row['update']:.3f} s "
            f"(first, with compile: {row['first']:.1f} s; loss {row['loss']:.4f})"
        )
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
