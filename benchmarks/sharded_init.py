"""Where the step-0 state lives while it is created: sharded initialisation vs one device first.

Builds one packed-sft program (the demo reversal data, ``shard_params: true``) in a process
that sees N forced host devices and creates its step-0 state twice:

- **baseline**, what the worker did before: the state initialised op by op on device 0,
  then ``jax.device_put`` onto the mesh (a whole copy on device 0 first);
- **sharded**: ``init_state()`` after ``lay_out_mesh()``, one program compiled with the
  state's output shardings (each device computes only its slices).

Prints, per device, the bytes of state the creation leaves or needs there (baseline: device
0 holds the whole state before the transfer; sharded: the slices each device holds, and the
compiled program's outputs + temporaries from ``memory_analysis()``), the ratio to the
baseline, both complete-state hashes (they must be equal), and the seconds each took
(compilation included; N *simulated* devices share the CPU cores, so the times say nothing
about accelerators).

Usage: uv run python benchmarks/sharded_init.py [--devices 4] [--d-model 256] [--layers 4]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import tempfile
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=4)
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    args = parser.parse_args()
    if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={args.devices}"
        os.environ["JAX_PLATFORMS"] = "cpu"
        os.execv(sys.executable, [sys.executable, *sys.argv])

    import jax
    import numpy as np

    from minifield import recipe as recipes
    from minifield.data import encoding
    from minifield.state.arrays import state_hash
    from minifield.strategies.packed_sft import demo_data

    root = Path(tempfile.mkdtemp(prefix="sharded-init-"))
    data = root / "in" / "sft"
    data.mkdir(parents=True)
    pins = {}
    for split, rows in demo_data.demo_examples().items():
        blob = encoding.to_jsonl(rows)
        (data / f"{split}.jsonl").write_bytes(blob)
        pins[split] = hashlib.sha256(blob).hexdigest()
    document = {
        "job_id": "sharded-init-bench",
        "product": {"name": "string-reverser", "version": "bench"},
        "strategy": {"name": "packed-sft", "version": "12.0.0"},
        "inputs": [
            {"name": s, "path": f"sft/{s}.jsonl", "sha256": pins[s]}
            for s in ("train", "dev", "test")
        ],
        "model": {
            "d_model": args.d_model,
            "n_layers": args.layers,
            "n_heads": 4,
            "d_ff": 4 * args.d_model,
        },
        "training": {
            "seq_len": 64,
            "batch_size": 4 * args.devices,
            "data_parallel": {"devices": args.devices, "shard_params": True},
        },
        "limits": {"max_steps": 30},
    }
    path = root / "recipe.json"
    path.write_text(json.dumps(document))
    recipe = recipes.load(path)
    files = {i["name"]: root / "in" / i["path"] for i in recipe.data["inputs"]}
    arrays = recipe.strategy.prepare(recipe.data, files)[0]
    program = recipe.strategy.build(recipe.data, arrays)
    program.lay_out_mesh()
    shardings = program.layout.state

    started = time.perf_counter()
    on_device_0 = program.start.on_one_device()
    jax.block_until_ready(on_device_0)
    state_bytes = sum(leaf.nbytes for leaf in jax.tree_util.tree_leaves(on_device_0))
    baseline = jax.block_until_ready(jax.device_put(on_device_0, shardings))
    baseline_seconds = time.perf_counter() - started
    baseline_hash = state_hash(baseline)
    del on_device_0, baseline

    started = time.perf_counter()
    sharded = jax.block_until_ready(program.init_state())
    sharded_seconds = time.perf_counter() - started
    per_device = {d.id: 0 for d in jax.devices()[: args.devices]}
    for leaf in jax.tree_util.tree_leaves(sharded):
        for shard in leaf.addressable_shards:
            per_device[shard.device.id] += shard.data.nbytes
    memory = program.start.compiled_on_mesh.memory_analysis()
    program_bytes = memory.output_size_in_bytes + memory.temp_size_in_bytes

    params = sum(int(np.size(a)) for a in jax.tree_util.tree_leaves(sharded["params"]))
    print(
        f"packed-sft d_model {args.d_model}, {args.layers} layers, {params / 1e6:.2f}M "
        f"parameters, shard_params on {args.devices} forced host devices; complete state "
        f"{state_bytes / 1e6:.2f} MB (parameters + AdamW moments)"
    )
    print(f"baseline: device 0 holds the whole state first  {state_bytes / 1e6:9.2f} MB  1.000")
    worst = max(per_device.values())
    print(
        f"sharded:  largest per-device share               {worst / 1e6:9.2f} MB  "
        f"{worst / state_bytes:.3f}"
    )
    print(
        f"sharded:  compiled init outputs + temporaries     {program_bytes / 1e6:9.2f} MB  "
        f"{program_bytes / state_bytes:.3f}"
    )
    print(f"per-device shares (MB): {[round(v / 1e6, 2) for v in per_device.values()]}")
    same = baseline_hash == state_hash(sharded)
    print(f"state hash baseline {baseline_hash[:16]}…, sharded equal: {same}")
    print(
        f"seconds (compilation included, simulated devices): baseline {baseline_seconds:.2f}, "
        f"sharded {sharded_seconds:.2f}"
    )
    if not same:
        raise SystemExit("the sharded initialisation changed the state's bits")


if __name__ == "__main__":
    main()
