"""One prepared device check: what to run when an accelerator (a GPU or a TPU) is available,
written to one JSON file.

Sections, in order, each in its own process with its own time limit inside one overall budget
(7.5 minutes by default, compilation included), so a failure, a crash or a timeout in one is
recorded with its error and the others still run; the JSON is rewritten after every section
(and while a section runs), so even a killed check leaves what it measured:

- ``device``: backend, devices, versions and XLA flags (the GPU determinism flags the worker
  adds), the project's device check (``device_check.check``) against a recipe that requires
  this backend, the measured BF16 matrix-multiply peak and memory bandwidth, and the part's
  nominal peaks where :data:`NOMINAL_PEAKS` knows it (H100, H200, TPU v5e);
- ``step_125m``, ``step_350m``: our packed-SFT step (``LlamaConfig`` + ``make_optimizer`` +
  ``make_train_step``, as the worker compiles it) against a minimal JAX+optax loop of the same
  model (``_llama_minimal.py``), Llama-style at about 125M and 350M parameters, BF16, sequence
  2048, fused (Pallas) attention in both; compile time, step time, tokens/s, model FLOP/s and
  MFU against the nominal dense BF16 peak (:data:`NOMINAL_PEAKS`; elsewhere the measured
  peak) and against the measured peak;
- ``recovery``: the recovery proof (``prove``: real workers under the supervisor) of a
  small Llama recipe on this device with the same execution options: a reference run, a run
  that crashes after update k, a resume from its last checkpoint; complete-state hashes
  compared update by update, judged by ``verdict``;
- ``checkpoint``: the 125M model's complete training state (on the device) committed as a raw
  fsync'd file, synchronously (``checkpoint.save``) and in the background (``CheckpointCadence``):
  bandwidths, blocking time ÷ synchronous time, one per-update state hash;
- ``determinism_cost`` (GPU only): our 125M step without the GPU determinism flags, to price
  them against ``step_125m``.

A ``summary`` lists the goals with the measured value and whether each is met: the GPU
issue's, and on a TPU the chip's (issue 49: MFU against the measured BF16 peak, as that issue
measures it).

On a GPU host (the ``cuda`` extra installs ``jax[cuda12]``)::

    benchmarks/gpu_check.sh [OUT.json]
    uv run --locked --extra cuda python benchmarks/device_check.py --out device_check.json

On a TPU host, ``--backend tpu``: XLA attention (the minimal loop's fused kernel is the GPU
one) and the memory options a recipe naming the TPU gets (remat of every block, the loss over
1024-token chunks); each step section records the device's peak bytes in use. See
docs/tpu.md.

On CPU, ``--tiny`` runs every section end to end with tiny models in well under a minute
(the test suite does, so the check cannot rot). See docs/device-check.md.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import json
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections import deque
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))

#: the JSON's format (``minifield-gpu-check/1`` before the check was named for any device)
FORMAT = "minifield-device-check/2"
SECTIONS = ("device", "step_125m", "step_350m", "recovery", "checkpoint", "determinism_cost")
#: each section's own time limit (seconds, compilation included); the overall budget caps it
SECTION_LIMIT_S = {
    "device": 90,
    "step_125m": 150,
    "step_350m": 180,
    "recovery": 180,
    "checkpoint": 120,
    "determinism_cost": 90,
}
BUDGET_S = 450.0  # the whole check: under 8 minutes on one H200
TINY_BUDGET_S = 300.0
NOT_APPLICABLE = "not_applicable"  # a section this backend has no use for (not a failure)
INTERRUPTED = threading.Event()  # set by SIGINT/SIGTERM in the parent
#: a section is not started with less time than this left in the budget
MIN_SECTION_S = 20.0

#: nominal peaks of the parts the issues name, by what their JAX ``device_kind`` contains:
#: dense BF16 matrix-multiply FLOP/s (no sparsity; the GPUs' SXM parts), HBM bytes and bytes/s
#: (the vendors' data sheets); the TPU v5e reports itself as "TPU v5 lite"
NOMINAL_PEAKS = {
    "H100": {"bf16_flops": 989e12, "hbm_bytes": 80e9, "hbm_bytes_per_s": 3.35e12},
    "H200": {"bf16_flops": 989e12, "hbm_bytes": 141e9, "hbm_bytes_per_s": 4.8e12},
    "TPU v5 lite": {"bf16_flops": 197e12, "hbm_bytes": 16e9, "hbm_bytes_per_s": 819e9},
}
#: BF16 matmul peaks measured on these parts before (FLOP/s): the TPU v5e's in issue 49
#: (docs/tpu.md), which its MFU figures there are taken against; this run's own is compared
REFERENCE_MEASURED_BF16 = {"TPU v5 lite": 164e12}

#: Llama-style models: name -> (d_model, layers, heads, kv heads, d_ff, vocabulary)
MODELS = {
    "125m": (768, 12, 12, 12, 1792, 32000),
    "350m": (1024, 24, 16, 16, 2560, 32000),
}
TINY_MODELS = {
    "125m": (32, 2, 2, 2, 64, 128),
    "350m": (64, 2, 4, 2, 96, 160),
}
SEQ_LEN, TINY_SEQ_LEN = 2048, 64
#: rows per step: 32k tokens at 125M, 16k at 350M (activations of 24 layers without remat)
BATCH = {"125m": 16, "350m": 8}
TINY_BATCH = {"125m": 2, "350m": 2}
#: with --jobs: the order sections start in (longest first on a CPU)
JOBS_ORDER = ("device", "recovery", "step_350m", "step_125m", "checkpoint", "determinism_cost")
MAX_STEPS = 1000  # the learning-rate schedule's length (the check runs far fewer)

#: the recovery proof's recipe: the demo's pinned data, a small Llama model
RECOVERY_MODEL = {"d_model": 256, "n_layers": 4, "n_heads": 4, "d_ff": 512}
TINY_RECOVERY_MODEL = {"d_model": 32, "n_layers": 1, "n_heads": 2, "d_ff": 64}
RECOVERY_SEQ_LEN = 128


def log(message: str) -> None:
    print(f"[device-check {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def _clean(value):
    """JSON-safe: non-finite floats become strings ("nan", "inf") instead of invalid JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {str(k): _clean(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_clean(v) for v in value]
    return value


def write_json(path: Path, value: dict) -> None:
    """Atomically (a reader sees the previous version or this one, never half of one)."""
    from minifield import atomic

    atomic.write_json(path, _clean(value))


# ----------------------------------------------------------------------------- shared settings


def model_shape(args, size: str):
    import _llama_minimal as minimal

    table = TINY_MODELS if args.tiny else MODELS
    return minimal.Shape(*table[size])


def seq_len(args) -> int:
    return TINY_SEQ_LEN if args.tiny else SEQ_LEN


def batch_rows(args, size: str) -> int:
    if args.batch:
        return args.batch
    return (TINY_BATCH if args.tiny else BATCH)[size]


def execution(args):
    from minifield.models.execution import Execution

    return Execution(
        attention=args.attention,
        scan_layers=args.scan_layers,
        remat=args.remat,
        loss_chunk_tokens=args.loss_chunk_tokens,
    )


def memory_defaults(backend: str) -> tuple[str, int]:
    """``(remat, loss_chunk_tokens)`` a recipe naming ``backend`` gets where it leaves them out
    (the TPU's are its accelerator defaults: ``models.execution.ACCELERATOR_DEFAULTS``)."""
    from minifield.models.execution import defaults_for

    found = defaults_for(backend)
    return found[("training", "remat")], found[("training", "loss_chunk_tokens")]


def llama_config(shape, seq: int, exec_options):
    from minifield.models.llama import LlamaConfig

    return LlamaConfig(
        vocab_size=shape.vocab_size,
        d_model=shape.d_model,
        n_layers=shape.n_layers,
        n_heads=shape.n_heads,
        n_kv_heads=shape.n_kv_heads,
        d_ff=shape.d_ff,
        max_len=seq,
        rope_theta=shape.rope_theta,
        norm_eps=shape.norm_eps,
        compute_dtype="bfloat16",
        execution=exec_options,
    )


def expected_backend(args) -> str:
    return args.backend or ("cpu" if args.tiny else "gpu")


def recovery_recipe(args) -> dict:
    """The demo recipe's pinned data and settings with a small Llama model computing as the
    step sections do; long enough (``max_steps``) that the proof's truncated runs end by the
    step limit, without the final evaluation."""
    import yaml

    recipe = yaml.safe_load((REPO / "config/recipes/sft-demo.yaml").read_text())
    recipe["job_id"] = "device-check-recovery"
    recipe["model"] = {
        "architecture": "llama",
        **(TINY_RECOVERY_MODEL if args.tiny else RECOVERY_MODEL),
        "compute_dtype": "bfloat16",
        "tokenizer": recipe["model"]["tokenizer"],
        "attention": args.attention,
        "scan_layers": args.scan_layers,
    }
    recipe["training"].update(
        seq_len=TINY_SEQ_LEN if args.tiny else RECOVERY_SEQ_LEN,
        batch_size=4 if args.tiny else 16,
        warmup_steps=2,
        remat=args.remat,
        loss_chunk_tokens=args.loss_chunk_tokens,
    )
    recipe["limits"] = {"max_steps": 1000}
    recipe["checkpoint"] = {"every_steps": 2 if args.tiny else 3, "keep": 2}
    recipe["evaluation"] = {"eval_every": 0, "max_generate_examples": 1, "batch_size": 4}
    recipe["runtime"] = {"backend": expected_backend(args)}
    return recipe


def count_params(tree) -> int:
    import jax

    return int(sum(math.prod(leaf.shape) for leaf in jax.tree_util.tree_leaves(tree)))


def nominal_peaks(device_kind: str) -> tuple[str | None, dict | None]:
    """``(part, its NOMINAL_PEAKS row)`` for a JAX ``device_kind``, or ``(None, None)``; a
    GPU's PCIe part (other peaks) is none of them."""
    for name, peaks in NOMINAL_PEAKS.items():
        if name in device_kind and "PCIe" not in device_kind:
            return name, peaks
    return None, None


def peak_for(device_kind: str, measured: float | None) -> tuple[float | None, str]:
    """The peak MFU is taken against: the part's nominal dense BF16 peak
    (:data:`NOMINAL_PEAKS`), else the BF16 matrix-multiply peak the device section measured."""
    name, peaks = nominal_peaks(device_kind)
    if peaks:
        return peaks["bf16_flops"], f"nominal dense BF16 peak of {name} ({device_kind})"
    if measured:
        return measured, f"measured BF16 x BF16 -> FP32 matmul peak ({device_kind})"
    return None, "no peak known"


def _installed(package: str) -> str | None:
    """The installed version of ``package`` (None: not installed)."""
    from importlib import metadata

    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def memory_bandwidth(n_bytes: int, rounds: int = 5) -> float:
    """Bytes/s of the default device's memory: an FP32 array of ``n_bytes`` read and written
    once (``x + 1``, the bytes moved counted twice), median of ``rounds`` after a warm-up."""
    import jax
    import jax.numpy as jnp

    x = jnp.zeros((n_bytes // 4,), jnp.float32)
    add = jax.jit(lambda a: a + 1.0)
    add(x).block_until_ready()
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        add(x).block_until_ready()
        times.append(time.perf_counter() - start)
    return 2 * x.size * 4 / statistics.median(times)


# ----------------------------------------------------------------------------- sections
# Each runs in a child process: ``section(args, context, report) -> dict``; ``report(dict)``
# records partial results (a timeout keeps them); ``context`` holds earlier sections' results.


def section_device(args, context, report) -> dict:
    from minifield.attempt import environment

    added = environment.add_gpu_determinism_flags()
    import jax
    from bench_matmul import peak_probe

    from minifield import recipe
    from minifield.attempt import device_check
    from minifield.attempt.events import EventLog
    from minifield.supervision import distributed

    fingerprint = environment.fingerprint()
    devices = []
    for device in jax.devices():
        stats = device.memory_stats() if hasattr(device, "memory_stats") else None
        devices.append(
            {
                "id": device.id,
                "platform": device.platform,
                "device_kind": device.device_kind,
                "memory_bytes_limit": (stats or {}).get("bytes_limit"),
            }
        )
    out = {
        "backend": jax.default_backend(),
        "expected_backend": expected_backend(args),
        "devices": devices,
        "device_count": len(devices),
        "jax": fingerprint["jax"],
        "jaxlib": fingerprint["jaxlib"],
        "jax_cuda12_plugin": fingerprint.get("jax_cuda12_plugin"),
        "jax_cuda13_plugin": fingerprint.get("jax_cuda13_plugin"),
        "libtpu": _installed("libtpu"),
        "xla_flags": fingerprint["xla_flags"],
        "determinism_flags_added": added,
        "source_revision": fingerprint["source_revision"],
        "cpu_count": os.cpu_count(),
    }
    report(out)
    # The project's own device check, on the recovery recipe (runtime.backend = the backend
    # this check expects): it refuses a host where JAX fell back to another backend.
    checked = recipe.validate(recovery_recipe(args), "<device-check recovery recipe>")
    events_path = Path(args.work_dir) / "device-events.jsonl"
    try:
        device_check.check(checked, fingerprint, distributed.Group(), EventLog(events_path, None))
        out["device_check"] = {"passed": True, "error": None}
    except RuntimeError as exc:
        out["device_check"] = {"passed": False, "error": str(exc)}
    events = [json.loads(line) for line in events_path.read_text().splitlines()]
    out["device_event"] = {k: v for k, v in events[0].items() if k not in ("seq", "time", "mono")}
    report(out)
    n = 256 if args.tiny else 8192  # a GPU needs a large product to reach its peak
    log(f"matmul peak probe at n={n}")
    gflops = statistics.median(
        [p["bf16_f32acc"] for p in (peak_probe(n)() for _ in range(3))]
    )  # fmt: skip
    out["matmul_n"] = n
    out["matmul_peak_bf16_flops"] = gflops * 1e9
    n_bytes = 2**24 if args.tiny else 2**30  # an accelerator's memory needs 1 GiB to stream
    out["memory_bandwidth_array_bytes"] = n_bytes
    out["memory_bandwidth_bytes_per_s"] = memory_bandwidth(n_bytes)
    part, peaks = nominal_peaks(devices[0]["device_kind"])
    out["part"], out["nominal_peaks"] = part, peaks
    if peaks:  # how near this run came to the data sheet
        out["matmul_over_nominal"] = out["matmul_peak_bf16_flops"] / peaks["bf16_flops"]
        out["bandwidth_over_nominal"] = (
            out["memory_bandwidth_bytes_per_s"] / peaks["hbm_bytes_per_s"]
        )
    reference = REFERENCE_MEASURED_BF16.get(part)
    out["reference_measured_bf16_flops"] = reference
    if reference:
        out["matmul_over_reference_measured"] = out["matmul_peak_bf16_flops"] / reference
    if not out["device_check"]["passed"]:
        raise RuntimeError(out["device_check"]["error"])
    return out


def _time_rounds(runs: dict, rounds: int, steps: int, deadline: float, report, out) -> dict:
    """Interleaved rounds: each round runs ``steps`` steps of every implementation back to back
    (order alternating), so the ratio of a round compares the same few seconds."""
    import jax

    seconds = {name: [] for name in runs}
    names = list(runs)
    for r in range(rounds):
        # stop early rather than be killed: leave a round's worth of time
        if r and time.time() + 1.5 * sum(seconds[n][-1] * steps for n in names) > deadline:
            log(f"  stopping after {r} rounds (time limit)")
            break
        for name in names if r % 2 == 0 else names[::-1]:
            started = time.perf_counter()
            for _ in range(steps):
                result = runs[name]()
            jax.block_until_ready(result)
            seconds[name].append((time.perf_counter() - started) / steps)
        out["rounds_done"] = r + 1
        report(out)
        log(f"  round {r + 1}: " + ", ".join(f"{n} {seconds[n][-1] * 1e3:.1f} ms" for n in names))
    return seconds


def _step_section(args, context, report, size: str, deterministic: bool = True) -> dict:
    from minifield.attempt import environment

    if deterministic:
        environment.add_gpu_determinism_flags()
    import _llama_minimal as minimal
    import jax
    import jax.numpy as jnp

    from minifield.models import llama
    from minifield.training.optimizer import make_optimizer
    from minifield.training.train_step import init_train_state, make_train_step

    shape, seq, rows = model_shape(args, size), seq_len(args), batch_rows(args, size)
    cfg = llama_config(shape, seq, execution(args))
    flops_per_token = llama.flops_per_token(cfg, seq)
    device_kind = jax.devices()[0].device_kind
    measured = (context.get("device") or {}).get("matmul_peak_bf16_flops")
    peak, peak_source = peak_for(device_kind, measured)
    out = {
        "model": {
            "architecture": "llama",
            **{k: getattr(cfg, k) for k in ("vocab_size", "d_model", "n_layers", "n_heads")},
            **{k: getattr(cfg, k) for k in ("n_kv_heads", "d_ff", "tie_embeddings")},
        },
        "compute_dtype": cfg.compute_dtype,
        "execution": {
            "attention": cfg.execution.attention,
            "scan_layers": cfg.execution.scan_layers,
            "remat": cfg.execution.remat,
            "loss_chunk_tokens": cfg.execution.loss_chunk_tokens,
        },
        "seq_len": seq,
        "batch_rows": rows,
        "tokens_per_step": rows * seq,
        "flops_per_token": flops_per_token,
        "flops_per_step": flops_per_token * rows * seq,
        "backend": jax.default_backend(),
        "device_kind": device_kind,
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "peak_flops": peak,
        "peak_source": peak_source,
        "measured_matmul_peak_flops": measured,
    }
    if args.tiny:  # the full-size model's count, from shapes alone (nothing allocated)
        full = llama_config(minimal.Shape(*MODELS[size]), SEQ_LEN, execution(args))
        shapes = jax.eval_shape(lambda: llama.init_params(full, jax.random.key(0)))
        out["full_size"] = {
            "model": {k: getattr(full, k) for k in ("d_model", "n_layers", "n_heads", "d_ff")},
            "param_count": count_params(shapes),
            "flops_per_token": llama.flops_per_token(full, SEQ_LEN),
        }
    report(out)

    batch = minimal.packed_batch(rows, seq, shape.vocab_size)
    implementations = {}
    optimizer = make_optimizer({}, MAX_STEPS)
    # one compiled program, created on the device (op by op it is a dispatch per array)
    state = jax.jit(lambda: init_train_state(cfg, optimizer, seed=0))()
    out["param_count"] = count_params(state["params"])
    started = time.perf_counter()
    ours = jax.jit(make_train_step(cfg, optimizer), donate_argnums=(0,))
    ours = ours.lower(state, batch).compile()
    out.setdefault("ours", {})["compile_s"] = time.perf_counter() - started
    log(f"  ours compiled in {out['ours']['compile_s']:.1f} s ({out['param_count']:,} params)")
    box = {"state": state}

    def run_ours():
        box["state"], metrics = ours(box["state"], batch)
        return metrics["loss"]

    implementations["ours"] = run_ours
    first_loss = {"ours": float(run_ours())}  # the warm-up step, before another model exists
    # the device's own count (None where it keeps none, the CPU): what this step needs
    stats = jax.devices()[0].memory_stats() or {}
    out["ours"]["peak_bytes_in_use"] = stats.get("peak_bytes_in_use")
    report(out)
    if not args.ours_only:
        # the same remat as ours: on a TPU, every layer's scores kept at once do not fit
        step, params, opt_state = minimal.make_step(
            shape, jnp.bfloat16, MAX_STEPS, attention=cfg.execution.attention,
            remat=cfg.execution.remat,
        )  # fmt: skip
        out["minimal"] = {"param_count": count_params(params)}
        started = time.perf_counter()
        step = step.lower(params, opt_state, batch).compile()
        out["minimal"]["compile_s"] = time.perf_counter() - started
        log(f"  minimal compiled in {out['minimal']['compile_s']:.1f} s")
        mini = {"params": params, "opt_state": opt_state}

        def run_minimal():
            mini["params"], mini["opt_state"], loss = step(mini["params"], mini["opt_state"], batch)
            return loss

        implementations["minimal"] = run_minimal
        first_loss["minimal"] = float(run_minimal())
        report(out)
    seconds = _time_rounds(
        implementations, args.rounds, args.steps_per_round, args.deadline, report, out
    )
    for name, run in implementations.items():
        step_s = statistics.median(seconds[name])
        row = out[name]
        row.update(
            step_s=step_s,
            step_s_rounds=seconds[name],
            loss_first=first_loss[name],
            loss_last=float(run()),
            tokens_per_s=out["tokens_per_step"] / step_s,
            model_flops_per_s=out["flops_per_step"] / step_s,
            mfu=out["flops_per_step"] / step_s / peak if peak else None,
            # against what a plain BF16 matmul reaches on this device (the achievable peak)
            mfu_vs_measured_peak=out["flops_per_step"] / step_s / measured if measured else None,
        )
        log(
            f"  {name}: {step_s * 1e3:.1f} ms/step, {row['tokens_per_s']:.0f} tokens/s, "
            f"{row['model_flops_per_s'] / 1e12:.2f} TFLOP/s"
            + (f", MFU {row['mfu']:.1%}" if row["mfu"] is not None else "")
        )
    if "minimal" in implementations:
        out["ours_over_minimal"] = statistics.median(
            o / m for o, m in zip(seconds["ours"], seconds["minimal"], strict=True)
        )
        log(f"  ours / minimal = {out['ours_over_minimal']:.3f}")
    return out


def section_step_125m(args, context, report) -> dict:
    return _step_section(args, context, report, "125m")


def section_step_350m(args, context, report) -> dict:
    return _step_section(args, context, report, "350m")


def section_determinism_cost(args, context, report) -> dict:
    # run without the determinism flags (the parent removed them from XLA_FLAGS); compared
    # with step_125m's "ours", which ran with them
    args.ours_only = True
    out = _step_section(args, context, report, "125m", deterministic=False)
    with_flags = ((context.get("step_125m") or {}).get("ours") or {}).get("step_s")
    if with_flags:
        out["deterministic_over_default"] = with_flags / out["ours"]["step_s"]
    return out


def section_recovery(args, context, report) -> dict:
    from minifield import recipe as recipes
    from minifield.proof.prove import prove
    from minifield.proof.verdict import verdict
    from minifield.supervision import supervise as supervisor

    work = Path(args.work_dir) / "recovery"
    recipe_path = work / "recipe.json"
    work.mkdir(parents=True, exist_ok=True)
    recipe_path.write_text(json.dumps(recovery_recipe(args), indent=2))
    checked = recipes.load(recipe_path)
    limit = max(args.deadline - time.time(), 10.0)
    # every worker is bounded by what is left of the section
    supervision = supervisor.Settings(deadline_s=limit, stall_s=limit, grace_s=5.0)
    log(f"  recovery proof ({args.proof_mode}) of {checked.computation_digest[:16]}")
    proof = prove(
        recipe_path, REPO / "data", work, work / "proof.json",
        mode=args.proof_mode, supervision=supervision,
    )  # fmt: skip
    reasons = verdict(proof, checked.computation_digest)
    reference = {h["step"]: h["state_hash"] for h in proof["reference"]["state_hashes"]}
    out = {
        "recipe": {k: checked.data[k] for k in ("model", "training", "checkpoint", "runtime")},
        "computation_digest": checked.computation_digest,
        "mode": args.proof_mode,
        "steps": proof["settings"]["steps"],
        "fail_after_step": proof["settings"]["fail_after_step"],
        "passed": proof["passed"],
        "verdict_reasons": reasons,
        "bit_exact": proof["passed"] and not reasons,
        "diagnosis": proof["diagnosis"],
        "seconds": proof["seconds"],
        "reference_state_hashes": reference,
        "proof": str(work / "proof.json"),
    }
    for part in ("reference", "faulted", "resumed"):
        record = proof.get(part) or {}
        out[f"{part}_attempt_dir"] = record.get("attempt_dir")
    if proof.get("reference"):
        attempt = json.loads((Path(out["reference_attempt_dir"]) / "attempt.json").read_text())
        env = attempt["environment"]
        out["environment"] = {k: env.get(k) for k in ("backend", "device_kind", "xla_flags")}
    if proof.get("resumed"):  # no hashes where the proof stopped at a problem (its diagnosis)
        hashes = proof["resumed"].get("state_hashes") or []
        resumed = {h["step"]: h["state_hash"] for h in hashes}
        out["resumed_state_hashes"] = resumed
        out["checkpoint_step"] = (proof.get("checkpoint_used") or {}).get("step")
        out["steps_compared"] = sorted(s for s in resumed if s in reference)
    if proof.get("preempted"):
        out["preempted_passed"] = proof["preempted"].get("passed")
    return out


def section_checkpoint(args, context, report) -> dict:
    from minifield.attempt import environment

    environment.add_gpu_determinism_flags()
    import jax
    import numpy as np
    from checkpoint_commit import async_commit, raw_commit, sync_commit

    from minifield.attempt.update_loop import HostSnapshot
    from minifield.state.arrays import named_arrays
    from minifield.training.optimizer import make_optimizer
    from minifield.training.train_step import init_train_state

    cfg = llama_config(model_shape(args, "125m"), seq_len(args), execution(args))
    optimizer = make_optimizer({}, MAX_STEPS)
    state = jax.jit(lambda: init_train_state(cfg, optimizer, seed=0))()
    jax.block_until_ready(state)
    arrays = named_arrays(state)
    nbytes = sum(int(np.dtype(a.dtype).itemsize) * math.prod(a.shape) for a in arrays.values())
    out = {
        "model": "125m",
        "state_bytes": nbytes,
        "arrays": len(arrays),
        "backend": jax.default_backend(),
        "rounds": args.checkpoint_rounds,
    }
    report(out)
    directory = Path(tempfile.mkdtemp(prefix="checkpoint-", dir=args.work_dir))
    try:
        started = time.perf_counter()
        host = b"".join(np.ascontiguousarray(a).tobytes() for a in arrays.values())
        out["device_to_host_s"] = time.perf_counter() - started
        rows = {"raw_s": [], "sync_s": [], "sync_cpu_s": [], "blocked_s": [], "durable_s": []}
        for step in range(1, args.checkpoint_rounds + 1):
            spent = (
                sum(rows[k][-1] for k in ("raw_s", "sync_s", "durable_s")) if rows["raw_s"] else 0
            )
            if time.time() + 1.5 * spent > args.deadline:  # stop rather than be killed
                log(f"  stopping after {step - 1} rounds (time limit)")
                break
            rows["raw_s"].append(raw_commit(directory, host))
            wall, cpu = sync_commit(directory / "sync", state, step)
            rows["sync_s"].append(wall)
            rows["sync_cpu_s"].append(cpu)
            blocked, durable = async_commit(directory / "async", state, step)
            rows["blocked_s"].append(blocked)
            rows["durable_s"].append(durable)
            out["rounds_done"] = step
            out["all"] = rows
            report(out)
            log(f"  round {step}: " + ", ".join(f"{k} {v[-1]:.3f}" for k, v in rows.items()))
        del host
        median = {k: statistics.median(v) for k, v in rows.items()}
        out.update(median)
        out["raw_fsync_bytes_per_s"] = nbytes / median["raw_s"]
        out["sync_commit_bytes_per_s"] = nbytes / median["sync_s"]
        out["sync_over_raw_bandwidth"] = median["raw_s"] / median["sync_s"]
        out["blocking_over_sync_time"] = median["blocked_s"] / median["sync_s"]
        # what a per-update state hash costs at this size (host copy + hashes, as the loop)
        started = time.perf_counter()
        snapshot = HostSnapshot()
        snapshot.hashes_of(state, 1)
        snapshot.forget()
        out["state_hash_s"] = time.perf_counter() - started
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    return out


SECTION_FUNCTIONS = {
    "device": section_device,
    "step_125m": section_step_125m,
    "step_350m": section_step_350m,
    "recovery": section_recovery,
    "checkpoint": section_checkpoint,
    "determinism_cost": section_determinism_cost,
}


def run_section_child(args) -> int:
    """In the child: run one section, write its result (partial ones on the way)."""
    out_path = Path(args.section_out)
    context = json.loads(Path(args.context).read_text()) if args.context else {}

    def report(partial: dict) -> None:
        write_json(out_path, {"status": "running", **partial})

    partial: dict = {}

    def keep(value: dict) -> None:
        partial.clear()
        partial.update(value)
        report(value)

    try:
        result = SECTION_FUNCTIONS[args.section](args, context, keep)
    except Exception as exc:  # recorded, not raised: the parent reads the file
        write_json(
            out_path,
            {
                **partial,
                "status": "failed",
                "error": f"{type(exc).__name__}: {exc}",
                "traceback": traceback.format_exc()[-4000:],
            },
        )
        log(f"section {args.section} failed: {type(exc).__name__}: {exc}")
        return 1
    write_json(out_path, {**result, "status": "ok"})
    return 0


# ----------------------------------------------------------------------------- the parent


def _child_env(section: str) -> dict:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if section == "determinism_cost":
        flags = [f for f in env.get("XLA_FLAGS", "").split() if "deterministic_ops" not in f]
        env["XLA_FLAGS"] = " ".join(flags)
    return env


def _echo(stream, tail: deque) -> None:
    for line in iter(stream.readline, ""):
        sys.stderr.write(line)
        sys.stderr.flush()
        tail.append(line.rstrip("\n"))


def _processes() -> dict[int, tuple[int, int]]:
    """pid -> (parent pid, start time) of every process (Linux ``/proc``; elsewhere none)."""
    found = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            found[int(stat.parent.name)] = (int(fields[1]), int(fields[19]))
        except (OSError, IndexError, ValueError):
            continue
    return found


def _tree(pid: int) -> dict[int, int]:
    """``pid`` and every process below it, each with its start time (which tells a process
    from a later one that reuses its id). The section's process starts workers in sessions of
    their own, which a signal to its process group would not reach."""
    table = _processes()
    found = {pid: table[pid][1]} if pid in table else {}
    todo = [pid]
    while todo:
        parent = todo.pop()
        for child, (ppid, start) in table.items():
            if ppid == parent and child not in found:
                found[child] = start
                todo.append(child)
    return found


def _signal_tree(tree: dict[int, int], sig: int) -> None:
    table = _processes()
    for pid, start in tree.items():
        if table.get(pid, (None, None))[1] == start:  # still the process we saw
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)


def _stop(child: subprocess.Popen) -> None:
    """End a section's process and everything it started: SIGTERM (a worker commits a
    checkpoint and exits), then SIGKILL to whatever is left after 10 s."""
    tree = _tree(child.pid)
    _signal_tree(tree, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        child.wait(10)
    _signal_tree({**tree, **_tree(child.pid)}, signal.SIGKILL)
    child.wait()


def run_section(args, name: str, limit: float, context_path: Path, record) -> dict:
    """Run section ``name`` in a child process within ``limit`` seconds; its result (or what
    it had when it failed or ran out of time) with ``status`` and ``seconds``. ``record(name,
    partial)`` receives its partial results while it runs."""
    section_out = Path(args.work_dir) / f"section-{name}.json"
    section_out.unlink(missing_ok=True)
    command = [
        sys.executable, str(Path(__file__).resolve()), *args.passthrough,
        "--section", name, "--section-out", str(section_out), "--context", str(context_path),
        "--deadline", repr(time.time() + limit - 5.0), "--work-dir", str(args.work_dir),
    ]  # fmt: skip
    started = time.monotonic()
    tail: deque = deque(maxlen=40)
    child = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=_child_env(name),
        cwd=REPO,
        start_new_session=True,  # a signal at the terminal reaches the parent only
    )
    reader = threading.Thread(target=_echo, args=(child.stdout, tail), daemon=True)
    reader.start()
    timed_out, seen = False, None
    try:
        while True:
            # the limit first: a section given 0 s is out of time however fast it is
            if time.monotonic() - started >= limit or INTERRUPTED.is_set():
                timed_out = True
                _stop(child)
                break
            try:
                child.wait(0.25)
                break
            except subprocess.TimeoutExpired:
                pass
            try:  # partial results land in the JSON as they come
                stamp = section_out.stat().st_mtime_ns
                if stamp != seen:
                    seen = stamp
                    record(name, json.loads(section_out.read_text()))
            except (OSError, json.JSONDecodeError):
                pass
    except BaseException:  # the child is in a session of its own: end it with the parent
        _stop(child)
        raise
    reader.join(5)
    seconds = time.monotonic() - started
    try:
        result = json.loads(section_out.read_text())
    except (OSError, json.JSONDecodeError):
        result = {}
    if timed_out and INTERRUPTED.is_set():
        result.update(status="interrupted", error="the check was interrupted (SIGINT/SIGTERM)")
    elif timed_out:
        result.update(status="timeout", error=f"no result within the {limit:.0f} s limit")
    elif child.returncode != 0 and result.get("status") != "failed":
        result.update(
            status="failed",
            error=f"the section's process exited with {child.returncode} "
            f"(a negative code is the signal that ended it)",
        )
    elif result.get("status") not in ("ok", "failed"):
        result.update(status="failed", error="the section's process wrote no result")
    if result["status"] != "ok":
        result["output_tail"] = list(tail)
    result["seconds"] = seconds
    result["limit_s"] = limit
    return result


def _get(sections: dict, name: str, *keys):
    value = sections.get(name)
    for key in keys:
        if not isinstance(value, dict):
            return None
        value = value.get(key)
    return value


def summary(sections: dict, tiny: bool) -> dict:
    """The issue's goals next to the measured values (``met``: None where not measured)."""

    def goal(value, target: str, ok) -> dict:
        return {"value": value, "goal": target, "met": None if value is None else bool(ok(value))}

    out = {
        "sections_ok": sorted(n for n, s in sections.items() if s.get("status") == "ok"),
        "sections_not_ok": sorted(
            n for n, s in sections.items() if s.get("status") not in ("ok", NOT_APPLICABLE)
        ),
        "tiny": tiny,
        "goals": {
            "mfu_350m": goal(
                _get(sections, "step_350m", "ours", "mfu"), ">= 0.45", lambda v: v >= 0.45
            ),
            "ours_over_minimal_125m": goal(
                _get(sections, "step_125m", "ours_over_minimal"), "<= 1.03", lambda v: v <= 1.03
            ),
            "ours_over_minimal_350m": goal(
                _get(sections, "step_350m", "ours_over_minimal"), "<= 1.03", lambda v: v <= 1.03
            ),
            "recovery_bit_exact": goal(
                _get(sections, "recovery", "bit_exact"), "true", lambda v: v is True
            ),
            "checkpoint_blocking_over_sync": goal(
                _get(sections, "checkpoint", "blocking_over_sync_time"),
                "<= 0.15",
                lambda v: v <= 0.15,
            ),
            "checkpoint_sync_over_raw_bandwidth": goal(
                _get(sections, "checkpoint", "sync_over_raw_bandwidth"),
                ">= 0.8",
                lambda v: v >= 0.8,
            ),
        },  # fmt: skip
        "mfu_125m": _get(sections, "step_125m", "ours", "mfu"),
        "determinism_flags_cost": _get(sections, "determinism_cost", "deterministic_over_default"),
    }
    if _get(sections, "device", "expected_backend") == "tpu":
        out["tpu_goals"] = tpu_goals(sections, goal)
    if tiny:
        out["note"] = "tiny models on this backend: the goals are for the full sizes on a GPU"
    return out


def tpu_goals(sections: dict, goal) -> dict:
    """The chip's goals (issue 49, item 2): MFU against the BF16 matmul peak this run
    measured, as that issue takes it, and ours over the minimal loop."""

    def mfu(size: str):
        return _get(sections, f"step_{size}", "ours", "mfu_vs_measured_peak")

    return {
        "mfu_350m_vs_measured_peak": goal(mfu("350m"), ">= 0.45", lambda v: v >= 0.45),
        "mfu_125m_vs_measured_peak": goal(mfu("125m"), ">= 0.40", lambda v: v >= 0.40),
        "ours_over_minimal_350m": goal(
            _get(sections, "step_350m", "ours_over_minimal"), "<= 1.03", lambda v: v <= 1.03
        ),
    }


def run_parent(args) -> int:
    budget = args.budget_s or (TINY_BUDGET_S if args.tiny else BUDGET_S)
    deadline = time.monotonic() + budget
    out_path = Path(args.out)
    own_work_dir = args.work_dir is None
    if own_work_dir:
        (REPO / "work").mkdir(exist_ok=True)
        args.work_dir = tempfile.mkdtemp(prefix="device-check-", dir=REPO / "work")
    args.work_dir = str(Path(args.work_dir).resolve())
    Path(args.work_dir).mkdir(parents=True, exist_ok=True)
    out = {
        "format": FORMAT,
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "command": [sys.executable, *sys.argv],
        "tiny": args.tiny,
        "budget_s": budget,
        "settings": {
            "attention": args.attention,
            "scan_layers": args.scan_layers,
            "remat": args.remat,
            "loss_chunk_tokens": args.loss_chunk_tokens,
            "rounds": args.rounds,
            "steps_per_round": args.steps_per_round,
            "proof_mode": args.proof_mode,
        },
        "sections": {},
        "summary": None,
    }

    lock = threading.RLock()  # sections may run side by side (--jobs): one writer at a time

    def save() -> None:
        with lock:
            out["elapsed_s"] = budget - (deadline - time.monotonic())
            write_json(out_path, out)

    def record(name: str, result: dict) -> None:
        with lock:
            out["sections"][name] = result
            save()

    def run_one(name: str) -> None:
        with lock:
            remaining = deadline - time.monotonic()
            device = out["sections"].get("device")
            if INTERRUPTED.is_set():
                result = {"status": "skipped", "error": "the check was interrupted"}
            elif name != "device" and device is not None and device.get("status") != "ok":
                result = {"status": "skipped", "error": "the device section did not pass"}
            elif name == "determinism_cost" and expected_backend(args) != "gpu":
                result = {"status": NOT_APPLICABLE, "reason": "the flags apply to GPUs only"}
            elif remaining < MIN_SECTION_S:
                result = {
                    "status": "skipped",
                    "error": f"only {remaining:.0f} s of the budget left",
                }
            else:
                result = None
                limit = args.section_limit.get(
                    name, SECTION_LIMIT_S[name] * (2 if args.tiny else 1)
                )
                limit = min(limit, remaining)
                log(f"section {name}: started (limit {limit:.0f} s)")
                record(name, {"status": "running"})
                context_path = Path(args.work_dir) / f"context-{name}.json"
                context_path.write_text(json.dumps(out["sections"]))
        if result is None:
            result = run_section(args, name, limit, context_path, record)
        record(name, result)
        why = result.get("error") or result.get("reason")
        log(f"section {name}: {result['status']}" + (f" ({why})" if why else ""))

    # SIGINT/SIGTERM: stop the running section(s) and their workers, skip the rest, and still
    # write the JSON (sections run in sessions of their own, so the signal reaches only us)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: INTERRUPTED.set())
    log(f"writing {out_path}; budget {budget:.0f} s; work in {args.work_dir}")
    for name in args.sections:
        out["sections"][name] = {"status": "pending"}
    # The device section first (the others need its verdict and measured peak); the rest one
    # after another on a GPU, or side by side with --jobs on a CPU (a GPU check must not: the
    # sections would share the device and its memory).
    rest = [name for name in args.sections if name != "device"]
    if "device" in args.sections:
        run_one("device")
    jobs = args.jobs
    device = out["sections"].get("device") or {}
    if jobs > 1 and device.get("backend", expected_backend(args)) != "cpu":
        log("--jobs ignored: sections share one accelerator, so they run one at a time")
        jobs = 1
    if jobs > 1:
        with concurrent.futures.ThreadPoolExecutor(jobs) as pool:
            # longest first, so the pool's last section is a short one
            for future in [pool.submit(run_one, n) for n in sorted(rest, key=JOBS_ORDER.index)]:
                future.result()
    else:
        for name in rest:
            run_one(name)
    out["summary"] = summary(out["sections"], args.tiny)
    out["finished"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    save()
    if own_work_dir and not args.keep_work:
        shutil.rmtree(args.work_dir, ignore_errors=True)
    log(f"done: {out_path} ({len(out['summary']['sections_ok'])}/{len(args.sections)} sections ok)")
    return 0 if not out["summary"]["sections_not_ok"] else 1


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="device_check.json", help="the JSON written (rewritten as "
                        "sections finish)")  # fmt: skip
    parser.add_argument("--tiny", action="store_true", help="tiny models: the CPU run of the tests")
    parser.add_argument("--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS))
    parser.add_argument("--budget-s", type=float, help=f"overall limit (default {BUDGET_S:.0f})")
    parser.add_argument("--work-dir", help="runs, checkpoints (default: a new work/device-check-*)")
    parser.add_argument("--keep-work", action="store_true", help="keep the default work dir")
    parser.add_argument("--backend", choices=("cpu", "gpu", "tpu"), help="the backend the device "
                        "check requires (default gpu; cpu with --tiny)")  # fmt: skip
    parser.add_argument("--attention", choices=("pallas", "xla"), help="the attention kernel of "
                        "every section (default pallas, the fused kernel, on a GPU; xla "
                        "with --tiny: Pallas's CPU interpreter is slow; xla on a TPU: the "
                        "minimal loop's fused kernel is the GPU one)")  # fmt: skip
    parser.add_argument("--scan-layers", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--remat", choices=("none", "full", "dots_saveable"), help="default: "
                        "what a recipe naming the backend gets (full on a TPU, else none)")  # fmt: skip
    parser.add_argument("--loss-chunk-tokens", type=int, help="the loss over chunks of this "
                        "many tokens; default: what a recipe naming the backend gets (1024 on "
                        "a TPU, else 0: all at once)")  # fmt: skip
    parser.add_argument("--batch", type=int, help="rows per step for both sizes (default: "
                        f"{BATCH}; tiny {TINY_BATCH})")  # fmt: skip
    parser.add_argument("--rounds", type=int, help="timed rounds (default 5; tiny 2)")
    parser.add_argument("--steps-per-round", type=int, help="steps per round (default 10; tiny 2)")
    parser.add_argument("--checkpoint-rounds", type=int, help="commits of each kind (default 2)")
    parser.add_argument("--jobs", type=int, default=1, help="sections run side by side after "
                        "the device section (CPU only: one GPU runs one section at a time)")  # fmt: skip
    parser.add_argument("--proof-mode", choices=("crash", "preempt", "both"), default="crash")
    # the parent starts itself with these for each section
    parser.add_argument("--section", choices=SECTIONS, help=argparse.SUPPRESS)
    parser.add_argument("--section-out", help=argparse.SUPPRESS)
    parser.add_argument("--context", help=argparse.SUPPRESS)
    parser.add_argument("--deadline", type=float, help=argparse.SUPPRESS)
    parser.add_argument("--ours-only", action="store_true", help=argparse.SUPPRESS)
    # NAME=SECONDS: a section's own limit (the tests time one out on purpose)
    parser.add_argument("--section-limit", action="append", default=[], help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    limits = {}
    for item in args.section_limit:
        name, _, seconds = item.partition("=")
        if name not in SECTIONS or not seconds.replace(".", "", 1).isdigit():
            parser.error(f"--section-limit: expected SECTION=SECONDS with a section of "
                         f"{', '.join(SECTIONS)}, got {item!r}")  # fmt: skip
        limits[name] = float(seconds)
    args.section_limit = limits
    backend = expected_backend(args)
    args.attention = args.attention or ("pallas" if backend == "gpu" and not args.tiny else "xla")
    remat, chunk = memory_defaults(backend)
    args.remat = args.remat or remat
    args.loss_chunk_tokens = chunk if args.loss_chunk_tokens is None else args.loss_chunk_tokens
    args.rounds = args.rounds or (2 if args.tiny else 5)
    args.steps_per_round = args.steps_per_round or (2 if args.tiny else 10)
    args.checkpoint_rounds = args.checkpoint_rounds or (1 if args.tiny else 2)
    # what every section's process is started with (the settings, not the parent's plumbing)
    args.passthrough = [
        *(["--tiny"] if args.tiny else []),
        *(["--backend", args.backend] if args.backend else []),
        "--attention", args.attention,
        "--scan-layers" if args.scan_layers else "--no-scan-layers",
        "--remat", args.remat,
        "--loss-chunk-tokens", str(args.loss_chunk_tokens),
        *(["--batch", str(args.batch)] if args.batch else []),
        "--rounds", str(args.rounds),
        "--steps-per-round", str(args.steps_per_round),
        "--checkpoint-rounds", str(args.checkpoint_rounds),
        "--proof-mode", args.proof_mode,
    ]  # fmt: skip
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.section:
        return run_section_child(args)
    return run_parent(args)


if __name__ == "__main__":
    sys.exit(main())
