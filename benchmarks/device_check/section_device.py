"""The ``device`` section: backend, devices, versions and XLA flags; the project's device check
against a recipe naming the expected backend; the measured BF16 matmul peak and memory
bandwidth against the part's nominal peaks."""

from __future__ import annotations

import json
import os
import statistics
from pathlib import Path

from device_check.common import (
    REFERENCE_MEASURED_BF16,
    installed,
    log,
    memory_bandwidth,
    nominal_peaks,
)
from device_check.settings import expected_backend, recovery_recipe


def run(args, context, report) -> dict:
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
        "libtpu": installed("libtpu"),
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
