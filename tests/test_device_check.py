"""The prepared device check (benchmarks/device_check), run end to end on CPU with tiny
models; its table of parts' peaks and the chip's goals, read without running it.

The check's JSON is read against facts worked out here: parameter counts and FLOPs from the
Llama formulas, MFU and ratios recomputed from the JSON's own raw timings, the recovery
proof's hashes from the runs' event files, the backend from this interpreter's JAX. And the
minimal loop the check compares our step with computes the same model as ours.

The tiny run is started as a host whose parents must keep off the accelerator would start
it: ``JAX_PLATFORMS=tpu`` (a backend this machine lacks: a process that starts JAX other than
on the CPU fails) with ``MINIFIELD_WORKER_JAX_PLATFORMS=cpu`` (what the processes that may open
the accelerator get), so every section passing shows that the check's parent and the recovery
section's prover kept off it and that its measuring processes were given the workers'
platforms (``minifield.supervision.accelerator``).
"""

from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from conftest import REPO, read_events

sys.path.insert(0, str(REPO / "benchmarks"))
from device_check import (  # noqa: E402
    common,
    parent,
    section_checkpoint,
    section_shapes,
    summary,
)

sys.path.remove(str(REPO / "benchmarks"))

SCRIPT = REPO / "benchmarks" / "device_check"  # run as a directory
RUN_SECTIONS = ("device", "step_125m", "step_350m", "recovery", "checkpoint", "shapes")
#: the tiny run's shapes section searches one model (each compile takes seconds here);
#: its search is checked against a brute force below
TINY_SHAPES_MODEL = "qwen2.5-0.5b"
#: as a parent on a host with an accelerator: JAX's platforms for the parents, the workers'
KEEP_OFF_ENV = {"JAX_PLATFORMS": "tpu", "MINIFIELD_WORKER_JAX_PLATFORMS": "cpu"}


def llama_params(d, layers, heads, kv_heads, d_ff, vocab):
    """Parameters of an untied Llama block stack, counted by hand: per layer q and o (D x D),
    k and v (D x G*K), gate, up, down (3 D x F), two RMSNorm scales; embedding, final norm,
    head."""
    kv = kv_heads * (d // heads)
    per_layer = 2 * d * d + 2 * d * kv + 3 * d * d_ff + 2 * d
    return layers * per_layer + vocab * d + d + d * vocab


def llama_flops_per_token(d, layers, heads, kv_heads, d_ff, vocab, seq):
    """6 x weights used in products (per layer 2 D^2 + 2 D G K + 3 D F, plus the head D V) +
    12 x layers x seq x D for attention scores and mixing (the full row, the usual count)."""
    kv = kv_heads * (d // heads)
    return (
        6 * (layers * (2 * d * d + 2 * d * kv + 3 * d * d_ff) + d * vocab) + 12 * layers * seq * d
    )


def _run(out: Path, *extra: str, timeout: int = 600) -> subprocess.CompletedProcess:
    # The tiny run checks that every section runs and what it records, not speed: without
    # XLA's backend optimisations its compilations take a third less time (the flag is
    # recorded in the JSON and every run of the recovery proof gets it alike).
    flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_backend_optimization_level=0".strip()
    # As on an offline GPU host (docs/device-check.md): the source tree on PYTHONPATH, and no
    # snakemake: an import of it anywhere in the check or its workers fails the check.
    blocker = out.parent / "no-snakemake" / "snakemake"
    blocker.mkdir(parents=True, exist_ok=True)
    (blocker / "__init__.py").write_text('raise ImportError("no snakemake on the GPU host")\n')
    path = os.pathsep.join([str(blocker.parent), str(REPO / "src")])
    env = {**os.environ, "XLA_FLAGS": flags, "PYTHONPATH": path, **KEEP_OFF_ENV}
    return subprocess.run(
        [sys.executable, str(SCRIPT), "--tiny", "--out", str(out), *extra],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        env=env,
    )


@pytest.fixture(scope="module")
def check(tmp_path_factory) -> dict:
    """One tiny run of every section (two at a time on the two cores), its work kept."""
    root = tmp_path_factory.mktemp("device-check")
    out = root / "tmp" / "x.json"
    proc = _run(out, "--jobs", "2", "--work-dir", str(root / "work"),
                "--shapes-models", TINY_SHAPES_MODEL)  # fmt: skip
    assert out.exists(), proc.stderr[-4000:]
    return {"proc": proc, "doc": json.loads(out.read_text())}


@pytest.mark.slow
def test_every_section_runs_end_to_end_on_cpu(check):
    proc, doc = check["proc"], check["doc"]
    sections = doc["sections"]
    statuses = {name: section["status"] for name, section in sections.items()}
    assert statuses == {**dict.fromkeys(RUN_SECTIONS, "ok"), "determinism_cost": "not_applicable"}
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert doc["format"] == "minifield-device-check/2" and doc["tiny"] is True
    assert doc["summary"]["sections_not_ok"] == []
    # progress went to stderr, the JSON to the file
    assert "section recovery: ok" in proc.stderr and proc.stdout == ""
    # every goal carries a value measured in this run
    assert all(goal["value"] is not None for goal in doc["summary"]["goals"].values())


@pytest.mark.slow
def test_device_section_names_the_cpu_backend_of_this_jax(check):
    device = check["doc"]["sections"]["device"]
    assert device["backend"] == "cpu" and device["expected_backend"] == "cpu"
    assert {d["platform"] for d in device["devices"]} == {"cpu"}
    assert device["device_count"] == len(device["devices"]) >= 1
    assert device["jax"] == metadata.version("jax")
    assert device["jaxlib"] == metadata.version("jaxlib")
    # the project's device check passed and its event says what it found
    assert device["device_check"] == {"passed": True, "error": None}
    assert device["device_event"]["backend"] == "cpu"
    assert device["device_event"]["device_count"] == device["device_count"]
    # on CPU no determinism flags are added (they are GPU flags)
    assert device["determinism_flags_added"] == []
    assert device["matmul_peak_bf16_flops"] > 0
    assert device["memory_bandwidth_bytes_per_s"] > 0
    # a CPU is none of the parts with data-sheet peaks, and has no TPU goals
    assert device["part"] is None and device["nominal_peaks"] is None
    assert "tpu_goals" not in check["doc"]["summary"]


@pytest.mark.slow
@pytest.mark.parametrize("size", ["125m", "350m"])
def test_step_section_counts_and_mfu_agree_with_the_formulas(check, size):
    section = check["doc"]["sections"][f"step_{size}"]
    model, seq, rows = section["model"], section["seq_len"], section["batch_rows"]
    dims = (model["d_model"], model["n_layers"], model["n_heads"], model["n_kv_heads"],
            model["d_ff"], model["vocab_size"])  # fmt: skip
    assert model["tie_embeddings"] is False
    # both implementations hold the model the formula counts
    assert section["param_count"] == llama_params(*dims)
    assert section["minimal"]["param_count"] == llama_params(*dims)
    assert section["flops_per_token"] == llama_flops_per_token(*dims, seq)
    assert section["tokens_per_step"] == rows * seq
    assert section["flops_per_step"] == section["flops_per_token"] * rows * seq
    assert section["compute_dtype"] == "bfloat16"
    assert section["execution"]["scan_layers"] is True

    # on CPU the peak is the matmul peak the device section measured
    device = check["doc"]["sections"]["device"]
    assert section["peak_flops"] == device["matmul_peak_bf16_flops"]
    assert section["peak_source"].startswith("measured")
    for impl in ("ours", "minimal"):
        row = section[impl]
        assert row["step_s"] == statistics.median(row["step_s_rounds"])
        assert len(row["step_s_rounds"]) == section["rounds_done"] >= 1
        assert math.isclose(row["mfu"], section["flops_per_step"] / row["step_s"] /
                            section["peak_flops"], rel_tol=1e-12)  # fmt: skip
        assert math.isclose(row["tokens_per_s"], rows * seq / row["step_s"], rel_tol=1e-12)
        assert row["mfu_vs_measured_peak"] == row["mfu"]  # on CPU the peak is the measured one
        assert row["compile_s"] > 0
        # a freshly initialised model predicts about uniformly: loss near ln(vocab)
        assert abs(row["loss_first"] - math.log(model["vocab_size"])) < 1.5
    ratios = [o / m for o, m in zip(section["ours"]["step_s_rounds"],
                                    section["minimal"]["step_s_rounds"], strict=True)]  # fmt: skip
    assert math.isclose(section["ours_over_minimal"], statistics.median(ratios), rel_tol=1e-12)


@pytest.mark.slow
def test_full_size_models_are_about_125m_and_350m_parameters(check):
    """The GPU sizes, counted from shapes by the tiny run, against the hand count of the
    documented dimensions (docs/device-check.md)."""
    sections = check["doc"]["sections"]
    small = sections["step_125m"]["full_size"]
    large = sections["step_350m"]["full_size"]
    assert small["model"] == {"d_model": 768, "n_layers": 12, "n_heads": 12, "d_ff": 1792}
    assert large["model"] == {"d_model": 1024, "n_layers": 24, "n_heads": 16, "d_ff": 2560}
    assert small["param_count"] == llama_params(768, 12, 12, 12, 1792, 32000) == 127_027_968
    assert large["param_count"] == llama_params(1024, 24, 16, 16, 2560, 32000) == 354_993_152
    assert large["flops_per_token"] == llama_flops_per_token(1024, 24, 16, 16, 2560, 32000, 2048)


@pytest.mark.slow
def test_recovery_proof_is_bit_exact_by_the_runs_own_events(check):
    recovery = check["doc"]["sections"]["recovery"]
    assert recovery["bit_exact"] is True and recovery["verdict_reasons"] == []
    assert recovery["environment"]["backend"] == "cpu"
    k, restored = recovery["fail_after_step"], recovery["checkpoint_step"]
    assert 1 <= restored <= k < recovery["steps"]

    def hashes(attempt_dir):
        events = read_events(Path(attempt_dir) / "events.jsonl")
        return {e["step"]: e["state_hash"] for e in events if e["type"] == "update"}

    reference = hashes(recovery["reference_attempt_dir"])
    faulted = hashes(recovery["faulted_attempt_dir"])
    resumed = hashes(recovery["resumed_attempt_dir"])
    assert sorted(reference) == list(range(1, recovery["steps"] + 1))
    assert max(faulted) == k  # it crashed right after update k
    # the resumed attempt redid the updates after the checkpoint, each bit-identical
    assert sorted(resumed) == list(range(restored + 1, recovery["steps"] + 1))
    assert all(resumed[s] == reference[s] for s in resumed)
    assert recovery["steps_compared"] == sorted(resumed)
    # and the JSON reports those very hashes
    assert {int(s): h for s, h in recovery["reference_state_hashes"].items()} == reference
    assert {int(s): h for s, h in recovery["resumed_state_hashes"].items()} == resumed
    attempt = json.loads((Path(recovery["resumed_attempt_dir"]) / "attempt.json").read_text())
    assert attempt["computation_digest"] == recovery["computation_digest"]


@pytest.mark.slow
def test_checkpoint_section_ratios_come_from_its_own_timings(check):
    sections = check["doc"]["sections"]
    checkpoint = sections["checkpoint"]
    # parameters + two AdamW moments in FP32, plus a few scalars (counts, step, cursor, rng)
    params = sections["step_125m"]["param_count"]
    assert 12 * params <= checkpoint["state_bytes"] < 12 * params + 256
    rows = checkpoint["all"]
    assert len(rows["raw_s"]) == checkpoint["rounds_done"] == checkpoint["rounds"]
    for name in ("raw_s", "sync_s", "blocked_s", "durable_s"):
        assert checkpoint[name] == statistics.median(rows[name])
    assert math.isclose(
        checkpoint["sync_over_raw_bandwidth"], checkpoint["raw_s"] / checkpoint["sync_s"]
    )
    assert math.isclose(
        checkpoint["blocking_over_sync_time"], checkpoint["blocked_s"] / checkpoint["sync_s"]
    )
    assert math.isclose(
        checkpoint["raw_fsync_bytes_per_s"], checkpoint["state_bytes"] / checkpoint["raw_s"]
    )
    # blocked is a part of the background commit's time to durability
    assert checkpoint["blocked_s"] <= checkpoint["durable_s"]
    # the commit against the slower of its two floors, round by round, then the median
    assert checkpoint["device_to_host_s"] == statistics.median(rows["device_to_host_s"])
    ratios = [s / max(a, b) for s, a, b in zip(rows["sync_s"], rows["device_to_host_s"],
                                               rows["raw_s"], strict=True)]  # fmt: skip
    assert checkpoint["commit_over_floor_rounds"] == pytest.approx(ratios, rel=1e-12)
    assert math.isclose(checkpoint["commit_over_floor"], statistics.median(ratios))
    goal = check["doc"]["summary"]["goals"]["checkpoint_commit_over_floor"]
    assert goal["value"] == checkpoint["commit_over_floor"] and goal["goal"] == "<= 1.25"


def test_a_fresh_state_is_new_buffers_of_the_same_bits():
    """Each checkpoint measurement's state: computed anew on the device (other buffers, so no
    host copy of the old arrays is reused), bit for bit the state it came from."""
    import jax
    import jax.numpy as jnp

    draw = np.random.default_rng(0)
    state = {
        "params": jnp.asarray(draw.standard_normal((8, 4)).astype(np.float32)),
        "count": jnp.asarray(np.int32(7)),
        "rng": jnp.asarray(draw.integers(0, 2**32, 2, dtype=np.uint32)),
        "scale": jnp.asarray(np.float32(-0.0)),
    }
    fresh = section_checkpoint._fresh(state, jax.jit(section_checkpoint._same))
    for name, old in state.items():
        new = fresh[name]
        assert new.dtype == old.dtype
        assert np.asarray(new).tobytes() == np.asarray(old).tobytes(), name
        assert new.unsafe_buffer_pointer() != old.unsafe_buffer_pointer(), name


@pytest.mark.slow
def test_only_workers_open_the_accelerator(check):
    """The run was started with JAX_PLATFORMS naming a backend this machine lacks (only the
    workers' platforms are the CPU): a parent, or a prover, that started JAX on its own
    platforms would have failed. Every section passed, and the proof's workers ran on the
    platforms the workers were given."""
    sections = check["doc"]["sections"]
    assert {sections[name]["status"] for name in RUN_SECTIONS} == {"ok"}
    assert sections["device"]["backend"] == "cpu"
    assert sections["recovery"]["environment"]["backend"] == "cpu"


def test_measuring_sections_get_the_workers_platforms_and_the_prover_keeps_off():
    """The environment each section's process is started with, from a parent that kept off
    (``keep_off`` left ``JAX_PLATFORMS=cpu`` and the original platforms for the workers)."""
    environ = {"JAX_PLATFORMS": "cpu", "MINIFIELD_WORKER_JAX_PLATFORMS": "tpu", "X": "1"}
    for name in ("device", "step_125m", "checkpoint", "shapes"):
        env = parent.child_env(name, environ)
        assert env["JAX_PLATFORMS"] == "tpu" and "MINIFIELD_WORKER_JAX_PLATFORMS" not in env
        assert env["X"] == "1"
    env = parent.child_env("recovery", environ)
    assert env["JAX_PLATFORMS"] == "cpu" and env["MINIFIELD_WORKER_JAX_PLATFORMS"] == "tpu"
    # JAX's own choice for the workers (nothing given): no JAX_PLATFORMS at all
    env = parent.child_env("device", {"JAX_PLATFORMS": "cpu", "MINIFIELD_WORKER_JAX_PLATFORMS": ""})
    assert "JAX_PLATFORMS" not in env


def tied_llama_params(d, layers, heads, kv_heads, d_ff, vocab, qkv_bias):
    """Parameters of a Llama with tied embeddings, counted by hand: per layer q and o (D x D),
    k and v (D x G*K), gate, up, down (3 D x F), two RMSNorm scales, Qwen2's q/k/v biases;
    the embedding (also the head) and the final norm."""
    kv = kv_heads * (d // heads)
    bias = d + 2 * kv if qkv_bias else 0
    per_layer = 2 * d * d + 2 * d * kv + 3 * d * d_ff + 2 * d + bias
    return layers * per_layer + vocab * d + d


def lora_params(d, layers, heads, kv_heads, d_ff, rank):
    """A and B of rank ``rank`` on q, k, v, o, gate, up and down of every layer."""
    kv = kv_heads * (d // heads)
    shapes = [(d, d), (d, kv), (d, kv), (d, d), (d, d_ff), (d, d_ff), (d_ff, d)]
    return layers * sum(rank * (i + o) for i, o in shapes)


@pytest.mark.slow
def test_shapes_section_counts_and_peaks(check):
    """The tiny shapes run: the states counted by hand, each compile's arguments the state and
    the batch, its peak the memory analysis' parts, and the answer the compiles' own."""
    shapes = check["doc"]["sections"]["shapes"]
    limit, seq = shapes["device_memory_bytes"], shapes["seq_len"]
    model = shapes["models"][TINY_SHAPES_MODEL]
    dims = model["shape"]
    dims = (dims["d_model"], dims["n_layers"], dims["n_heads"], dims["n_kv_heads"],
            dims["d_ff"], dims["vocab_size"])  # fmt: skip
    full, lora = model["full"], model["lora"]
    assert full["trained_params"] == tied_llama_params(*dims, qkv_bias=True)
    assert lora["trained_params"] == lora_params(*dims[:5], rank=16)
    # FP32 parameters and two AdamW moments, plus a few scalars
    assert 12 * full["trained_params"] <= full["state_bytes"] < 12 * full["trained_params"] + 256
    for row in (full, lora):
        assert row["complete"] is True
        for compiled in row["compiles"]:
            batch = compiled["rows"] * seq * 4 * 4  # tokens, segments, positions, loss mask
            assert compiled["argument_bytes"] == row["argument_bytes_without_batch"] + batch
            assert compiled["peak_bytes"] == (compiled["argument_bytes"] + compiled["output_bytes"]
                                              + compiled["temp_bytes"] - compiled["alias_bytes"])  # fmt: skip
            assert compiled["compile_s"] > 0
        fitted = {c["rows"]: c["peak_bytes"] <= limit for c in row["compiles"]}
        rows = row["largest_rows"]
        assert rows == 0 or fitted[rows]
        assert fitted.get(rows + 1) is False  # the next row was compiled and does not fit
    got = check["doc"]["summary"]["largest_rows"][TINY_SHAPES_MODEL]
    assert got == {"full": full["largest_rows"], "lora": lora["largest_rows"]}


@pytest.mark.slow  # a handful of compilations
@pytest.mark.parametrize("mode", ["full", "lora"])
def test_shapes_search_matches_a_brute_force(check, mode):
    """The tiny model's step compiled at 1, 2, 3, ... rows until one does not fit the tiny
    run's memory, here, one compile a row: the most rows that fit is the search's answer."""
    from minifield.models.execution import Execution

    shapes = check["doc"]["sections"]["shapes"]
    how = Execution(**{k: v for k, v in shapes["execution"].items()})
    cfg = section_shapes.config(TINY_SHAPES_MODEL, True, how)
    step, leading, _ = section_shapes.abstract_step(cfg, mode)
    limit, rows = shapes["device_memory_bytes"], 0
    while True:
        peak = section_shapes.compile_rows(step, leading, rows + 1, cfg.max_len)["peak_bytes"]
        if peak > limit:
            break
        rows += 1
    assert shapes["models"][TINY_SHAPES_MODEL][mode]["largest_rows"] == rows


def _brute_force(peaks: list, limit: int) -> int:
    """The most rows r with every peak up to r known and within ``limit``."""
    rows = 0
    while rows < len(peaks) and peaks[rows] is not None and peaks[rows] <= limit:
        rows += 1
    return rows


@pytest.mark.parametrize("seed", range(40))
def test_largest_fitting_agrees_with_a_brute_force(seed):
    """Peaks that grow with the rows (linear, curved, with steps, with compiles that fail for
    lack of memory and say nothing) against a scan of every row count."""
    draw = np.random.default_rng(seed)
    n = 300
    base, slope = draw.integers(0, 10**6), draw.integers(1, 10**5)
    curve, noise = draw.choice([0.0, 1.0, 50.0]), draw.choice([0.0, 0.05, 1.0])
    peaks = [int(base + slope * r + curve * r * r + noise * draw.integers(0, slope))
             for r in range(1, n)]  # fmt: skip
    limit = int(draw.uniform(0.5, 1.2) * peaks[-1])
    unknown_from = int(draw.integers(1, n))  # from here on a compile fails without a figure
    peaks = [p if r < unknown_from or p <= limit else None for r, p in enumerate(peaks)]
    measured = []

    def measure(rows):
        measured.append(rows)
        return peaks[rows - 1] if rows <= len(peaks) else None

    got, complete = section_shapes.largest_fitting(measure, limit, max_rows=10**6)
    assert complete and got == _brute_force(peaks, limit)
    assert len(measured) == len(set(measured))  # no row count compiled twice
    if curve == 0.0 and noise < 1 and unknown_from > got + 1:  # about linear: a handful
        assert len(measured) <= 5


def test_a_search_whose_line_overshoots_into_silent_failures_halves_the_gap():
    """The chip's 3B LoRA search: 1 and 2 rows grew by little (8.86, 9.02 GiB), so the line
    said 43 rows, and every compile from there failed without a figure; the search then
    halves the gap to the most rows known to fit instead of walking down a row at a time
    (it compiled 43, 42, ..., 28 and ran out of time)."""
    GiB = 2**30
    measured = []

    def measure(rows):
        measured.append(rows)
        peak = int((8.70 + 0.16 * rows + 0.25 * max(0, rows - 2)) * GiB)
        return peak if peak <= 15.75 * GiB else None  # fails to compile, says nothing

    got, complete = section_shapes.largest_fitting(measure, int(15.75 * GiB), max_rows=1024)
    assert complete and got == 18  # 8.70 + 0.16 * 18 + 0.25 * 16 = 15.58; 19 rows: 15.99
    assert len(measured) <= 9, measured


def test_largest_fitting_stops_when_told_and_keeps_what_it_found():
    peaks = [100 * r for r in range(1, 50)]
    calls = []

    def measure(rows):
        calls.append(rows)
        return peaks[rows - 1]

    got, complete = section_shapes.largest_fitting(measure, 1250, lambda: len(calls) < 2)
    assert (got, complete, calls) == (2, False, [1, 2])
    assert section_shapes.largest_fitting(lambda rows: None, 10) == (0, True)


def test_a_step_that_does_not_compile_does_not_fit(monkeypatch):
    """On a TPU a step over the memory fails to compile; the compiler's "Used X" may even
    read below the device's limit (it counts against its own capacity): still no fit."""
    import jax

    limit = 1000
    state = {"w": jax.ShapeDtypeStruct((10,), np.float32)}  # 40 bytes of arguments
    monkeypatch.setattr(section_shapes, "abstract_step", lambda cfg, mode: (None, (state,), 10))

    def compile_rows(step, leading, rows, seq):
        if rows <= 6:  # 160 + 140 a row: 6 rows take 1000 bytes, which fit exactly
            return {"rows": rows, "compile_s": 0.1, "peak_bytes": 160 + 140 * rows}
        # from 7 rows on the compiler refuses, and says less than the limit at 7
        return {"rows": rows, "compile_s": 0.1, "peak_bytes": None,
                "compiler_used_bytes": 900 if rows == 7 else 2000}  # fmt: skip

    monkeypatch.setattr(section_shapes, "compile_rows", compile_rows)
    cfg = type("Cfg", (), {"max_len": 8})()
    out: dict = {}
    clock = {"deadline": float("inf"), "longest": 0.0}
    section_shapes.search_one(cfg, "full", limit, clock, out, lambda: None)
    assert (out["largest_rows"], out["complete"]) == (6, True)
    assert [c["rows"] for c in out["compiles"]][-2:] == [6, 7]


def test_a_compile_out_of_memory_names_what_it_needed():
    """The chip's compiler's own words (docs/tpu.md: the minimal loop without remat)."""
    text = ("RESOURCE_EXHAUSTED: XLA:TPU compile permanent error. Ran out of memory in memory "
            "space hbm. Used 47.58G of 15.75G hbm. Exceeded hbm capacity by 31.83G.")  # fmt: skip
    assert section_shapes.out_of_memory(RuntimeError(text))
    assert section_shapes._used_bytes(text) == int(47.58 * 2**30)
    assert section_shapes._used_bytes("no figure") is None


@pytest.mark.slow
def test_a_section_out_of_time_is_recorded_and_the_check_goes_on(tmp_path):
    out = tmp_path / "x.json"
    # a limit of 0 s: out of time before the section could report anything, however fast
    # this machine is (the limit is checked before the first wait)
    proc = _run(out, "--sections", "step_125m", "determinism_cost",
                "--section-limit", "step_125m=0")  # fmt: skip
    assert proc.returncode == 1
    doc = json.loads(out.read_text())
    step = doc["sections"]["step_125m"]
    assert step["status"] == "timeout" and "0 s limit" in step["error"]
    assert step["limit_s"] == 0
    # the next section was still considered, and the summary names the one that failed
    assert doc["sections"]["determinism_cost"]["status"] == "not_applicable"
    assert doc["summary"]["sections_not_ok"] == ["step_125m"]
    assert doc["summary"]["goals"]["ours_over_minimal_125m"]["met"] is None


@pytest.mark.slow  # three JAX compilations
def test_minimal_loop_is_the_same_model_as_ours():
    """Same parameters, same packed batch: the minimal loop's loss (written from the equations)
    equals our Llama's (FP32, so the two differ only by summation order)."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        from minimal import llama as minimal
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    import jax
    import jax.numpy as jnp

    from minifield.models import llama
    from minifield.models.model import loss_fn

    shape = minimal.Shape(32, 2, 4, 2, 48, 96)
    cfg = llama.LlamaConfig(
        vocab_size=96, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=48, max_len=64,
        compute_dtype="float32",
    )  # fmt: skip
    # our parameter tree from shapes alone, filled with NumPy draws (fan-in scaled): any
    # values do for "the same model", and no initialisation program is compiled
    draw = np.random.default_rng(3)
    ours = jax.tree.map(
        lambda leaf: (draw.standard_normal(leaf.shape) / math.sqrt(leaf.shape[0])).astype(
            leaf.dtype
        ),
        jax.eval_shape(lambda key: llama.init_params(cfg, key), jax.random.key(3)),
    )
    blocks = [ours["blocks"][name] for name in sorted(ours["blocks"], key=int)]
    # norm scales other than the initial ones, each its own: a scale the minimal loop left
    # out, or applied at the other norm, changes the loss
    norms = [ours["final_norm"]] + [b[n] for b in blocks for n in ("attn_norm", "mlp_norm")]
    scales = draw.uniform(0.5, 1.5, (len(norms), 32)).astype(np.float32)
    for norm, scale in zip(norms, scales, strict=True):
        norm["scale"] = scale
    theirs = {
        "emb": ours["embed"]["tokens"],
        "norm": ours["final_norm"]["scale"],
        "head": ours["head"]["w"],
        "layers": [
            {
                "ln1": b["attn_norm"]["scale"],
                "ln2": b["mlp_norm"]["scale"],
                **{k: b["attn"][k] for k in ("wq", "wk", "wv", "wo")},
                "wg": b["mlp"]["w_gate"],
                "wu": b["mlp"]["w_up"],
                "wd": b["mlp"]["w_down"],
            }
            for b in blocks
        ],
    }
    batch = minimal.packed_batch(3, 64, 96, seed=1)
    assert int(batch.segments.max()) >= 2  # several segments per row
    expected = float(jax.jit(loss_fn, static_argnums=1)(ours, cfg, batch)[0])
    for remat in ("none", "full", "save_attention"):  # a TPU takes our remat (device-check.md)
        loss = jax.jit(minimal.loss, static_argnums=(2, 3, 4, 5, 6))
        got = float(loss(theirs, batch, shape, jnp.float32, "xla", minimal.swiglu, remat))
        assert math.isclose(got, expected, rel_tol=1e-5), (remat, got, expected)
    # over micro-batches of its rows (the step sections' --grad-accum-steps): the same token
    # mean and gradient as the whole batch at once, to FP32's rounding
    whole = minimal.accumulated(theirs, batch, shape, jnp.float32, "xla", "none", 1)
    micro = minimal.accumulated(theirs, batch, shape, jnp.float32, "xla", "none", 3)
    assert math.isclose(float(micro[0]), expected, rel_tol=1e-5)
    for a, b in zip(jax.tree.leaves(whole[1]), jax.tree.leaves(micro[1]), strict=True):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize(
    ("kind", "part", "flops", "hbm", "bandwidth"),
    [
        ("TPU v5 lite", "TPU v5 lite", 197e12, 16e9, 819e9),
        ("NVIDIA H200", "H200", 989e12, 141e9, 4.8e12),
        ("NVIDIA H100 80GB HBM3", "H100", 989e12, 80e9, 3.35e12),
        ("NVIDIA H100 PCIe", None, None, None, None),
        ("cpu", None, None, None, None),
    ],
)
def test_parts_peaks_are_the_data_sheets(kind, part, flops, hbm, bandwidth):
    """The v5e's peaks as docs/tpu.md and issue 49 give them (BF16 197 TFLOP/s nominal, HBM
    16 GB at 819 GB/s); MFU is taken against the nominal BF16 peak where the part is known,
    else against the measured one."""
    name, peaks = common.nominal_peaks(kind)
    assert name == part
    if part is None:
        assert peaks is None
        assert common.peak_for(kind, 5e12) == (5e12, f"measured BF16 x BF16 -> FP32 "
                                                     f"matmul peak ({kind})")  # fmt: skip
        return
    assert peaks == {"bf16_flops": flops, "hbm_bytes": hbm, "hbm_bytes_per_s": bandwidth}
    assert common.peak_for(kind, 5e12)[0] == flops


def test_a_tpu_run_is_judged_by_the_chips_goals():
    """On a TPU the summary holds issue 49's goals, MFU against the measured peak: 0.45 at
    350M, 0.40 at 125M; a section not run leaves its goal unjudged."""
    sections = {
        "device": {"status": "ok", "expected_backend": "tpu"},
        "step_350m": {"status": "ok", "ours": {"mfu_vs_measured_peak": 0.46, "mfu": 0.38},
                      "ours_over_minimal": 1.05},
    }  # fmt: skip
    goals = summary.summary(sections, tiny=False)["tpu_goals"]
    assert goals["mfu_350m_vs_measured_peak"] == {"value": 0.46, "goal": ">= 0.45", "met": True}
    assert goals["ours_over_minimal_350m"]["met"] is False
    assert goals["mfu_125m_vs_measured_peak"] == {"value": None, "goal": ">= 0.40", "met": None}


def test_the_step_sections_kernel_on_a_tpu_is_a_tpu_recipes_default():
    """Unasked, the step sections on a TPU time what a recipe of their 2048-token rows gets
    (splash), as splash (``backend`` in the execution, not the GPU kernel); the recovery
    recipe leaves the kernel to its own rows' default; an asked kernel is passed on."""
    from device_check.cli import parse_args
    from device_check.settings import execution, recovery_recipe

    from minifield import recipe as recipes

    args = parse_args(["--backend", "tpu"])
    assert args.attention == "pallas" and "--attention" not in args.passthrough
    assert execution(args).backend == "tpu"
    recovery = recipes.validate(recovery_recipe(args)).data["model"]
    assert "attention" not in recovery  # 128-token rows: the XLA path
    asked = parse_args(["--backend", "tpu", "--attention", "xla"])
    at = asked.passthrough.index("--attention")
    assert asked.attention == "xla" and asked.passthrough[at + 1] == "xla"
    assert parse_args(["--backend", "gpu"]).attention == "pallas"
    assert parse_args(["--tiny"]).attention == "xla"


def test_ours_only_reaches_every_sections_process():
    """``--ours-only`` (a sweep of our own settings) is passed to each section's process, whose
    own arguments then read it; unasked, the sections compare with the minimal loop."""
    from device_check.cli import parse_args

    args = parse_args(["--backend", "tpu", "--ours-only", "--remat", "save_attention"])
    section = parse_args([*args.passthrough, "--section", "step_350m"])
    assert section.ours_only and section.remat == "save_attention"
    plain = parse_args(["--backend", "tpu"])
    assert not parse_args([*plain.passthrough, "--section", "step_350m"]).ours_only


def test_the_step_sections_on_a_tpu_run_the_plan_a_tpu_recipe_gets(monkeypatch):
    """Unasked, the step sections on a TPU take ``remat: auto`` as a packed-sft recipe of
    their model does (``models.device_memory.plan``): at 350M ``dots_saveable`` in 4
    micro-batches of 2 rows, at 125M the 16 rows at once; the minimal loop gets the same
    (``execution``); the shapes and checkpoint sections, with no split to choose, ``full``;
    an asked policy and split are passed on as asked."""
    from device_check.cli import parse_args
    from device_check.settings import execution, step_plan

    from minifield.models import device_memory

    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))  # the model shapes: minimal/
    args = parse_args(["--backend", "tpu"])
    assert args.remat == "auto" and args.loss_chunk_tokens == 1024
    plans = {size: step_plan(args, size) for size in ("350m", "125m")}
    assert [(p.remat, p.grad_accum_steps) for p in plans.values()] == [
        ("dots_saveable", 4), ("dots_saveable", 1),
    ]  # fmt: skip
    assert all(p.estimated_bytes <= device_memory.AUTO_DEVICE_BYTES for p in plans.values())
    assert execution(args, plans["350m"].remat).remat == "dots_saveable"
    assert execution(args).remat == "full"
    asked = parse_args(["--backend", "tpu", "--remat", "full", "--grad-accum-steps", "2"])
    assert step_plan(asked, "350m") == device_memory.Plan("full", 2, None)
    assert parse_args(["--backend", "gpu"]).remat == "none"


@pytest.mark.slow  # compiles the tiny step
def test_a_minimal_loop_the_plan_does_not_fit_leaves_ours_timed_alone(monkeypatch):
    """At the TPU's default plan the minimal loop may not fit where ours does (at 125M its
    whole-batch logits: docs/tpu.md): its compiler's refusal is recorded and ours is timed
    alone, with no ratio, rather than the section failing."""
    import time

    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    from device_check import section_steps
    from device_check.cli import parse_args
    from minimal import llama as minimal

    refusal = "RESOURCE_EXHAUSTED: the total memory required for HLO temporaries (17.45G)"
    real = minimal.make_step

    class Refused:
        def lower(self, *_):
            return SimpleNamespace(compile=lambda: (_ for _ in ()).throw(RuntimeError(refusal)))

    def make_step(*args, **kwargs):
        _, params, opt_state = real(*args, **kwargs)
        return Refused(), params, opt_state

    monkeypatch.setattr(minimal, "make_step", make_step)
    args = parse_args(["--tiny", "--section", "step_125m"])
    args.deadline = time.time() + 200
    out = section_steps.step_125m(args, {}, lambda _: None)
    assert out["minimal"]["fits"] is False and refusal in out["minimal"]["error"]
    assert "ours_over_minimal" not in out and out["ours"]["step_s"] > 0
