"""A Hugging Face export of parameters sharded over several processes is written by the
processes that hold them (``minifield.hf.parallel_files``): 1 process × 4 devices, 2 × 2 and
4 × 1 (loopback, gloo) write the same files byte for byte as the ``safetensors`` library
writes from the whole host tensors, with no array copied whole to any process.

Each run is a process of ``tests/export_shards_probe.py`` (a BF16 Phi-3 in shards, with fused
matrices, sharded; an FP32 Mixtral replicated; its PEFT adapter, the experts' adapters
stacked, sharded).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import loopback
import ml_dtypes
import numpy as np
import pytest
from export_shards_probe import MIXTRAL, PHI3, host_adapters, host_params
from safetensors.numpy import load_file

from minifield.hf import checkpoint as hf_checkpoint
from minifield.training import peft_adapter

pytestmark = pytest.mark.slow  # every test starts JAX processes

SCRIPT = Path(__file__).with_name("export_shards_probe.py")
MAX_SHARD_SIZE = 4000  # bytes: the BF16 Phi-3 in 10 files


def run_probe(out: Path, count: int, devices_each: int) -> dict:
    """Process 0's report of ``count`` probe processes joined on loopback (1: alone)."""
    argv = [str(SCRIPT), "--out", str(out), "--max-shard-size", str(MAX_SHARD_SIZE)]
    if count > 1:
        return loopback.run_processes(argv, count, devices_each)
    done = subprocess.run(
        [sys.executable, *argv],
        capture_output=True,
        text=True,
        env=loopback.cpu_env(devices_each),
        timeout=240,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _files(directory: Path) -> dict[str, bytes]:
    return {
        path.relative_to(directory).as_posix(): path.read_bytes()
        for path in sorted(directory.rglob("*"))
        if path.is_file()
    }


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict[str, bytes]:
    """The same export from the whole host tensors, by the one-process writer (the
    ``safetensors`` library serialises each file)."""
    directory = tmp_path_factory.mktemp("whole")
    cfg, params = host_params(PHI3, 1)
    hf_checkpoint.write(directory / "phi3", cfg, params, "bfloat16", None, MAX_SHARD_SIZE)
    cfg, params = host_params(MIXTRAL, 2)
    settings, adapters = host_adapters(cfg, 3)
    hf_checkpoint.write(directory / "mixtral", cfg, params)
    adapter_dir = directory / "mixtral" / peft_adapter.ADAPTER_DIR
    peft_adapter.write_adapter(adapter_dir, settings, adapters, "base", cfg)
    return _files(directory)


def _check(report: dict, reference: dict[str, bytes], count: int) -> None:
    assert (report["processes"], report["devices"]) == (count, 4)
    assert 0 < report["sharded_arrays"] < report["arrays"]  # sharded and replicated ones
    # nothing copied whole to a host; the processes exchanged only their one-int agreements
    assert report["gathered"] == []
    assert all(size == 1 for size in report["exchanged"])
    # two agreements per set of files written (Phi-3's, Mixtral's, the adapter's) and two
    # around each of write_whole's two steps (the writes, the commit)
    assert len(report["exchanged"]) == (0 if count == 1 else 3 * 2 + 2 * 2)
    written = _files(Path(report["export"]))
    assert sorted(written) == sorted(reference)
    assert sum(name.endswith(".safetensors") for name in written) == 12
    for name, data in reference.items():
        assert written[name] == data, name


def _check_tensors(export: Path) -> None:
    """Tensor by tensor against the host parameters, by hand: HF's [out, in] matrices, the
    fused ones' parts stacked, BF16 rounded by ml_dtypes."""
    cfg, params = host_params(PHI3, 1)
    stored = {}
    for path in (export / "phi3").glob("*.safetensors"):
        stored.update(load_file(str(path)))
    blocks = params["blocks"]["00"]
    attn = blocks["attn"]
    qkv = np.concatenate([attn["wq"], attn["wk"], attn["wv"]], axis=1).T
    expected = {
        "model.embed_tokens.weight": params["embed"]["tokens"],
        "model.layers.0.self_attn.qkv_proj.weight": qkv,
        "model.layers.0.self_attn.o_proj.weight": attn["wo"].T,
    }
    for name, value in expected.items():
        want = value.astype(ml_dtypes.bfloat16)
        assert stored[name].dtype == want.dtype and stored[name].shape == want.shape, name
        assert stored[name].view(np.uint16).tobytes() == want.view(np.uint16).tobytes(), name
    cfg, _ = host_params(MIXTRAL, 2)
    _, adapters = host_adapters(cfg, 3)
    adapter = load_file(
        str(export / "mixtral" / peft_adapter.ADAPTER_DIR / "adapter_model.safetensors")
    )
    pair = adapters["blocks"]["01"]["moe"]["experts"]["w_gate"]
    prefix = "base_model.model.model.layers.1.block_sparse_moe.experts.3.w1"
    np.testing.assert_array_equal(adapter[f"{prefix}.lora_A.weight"], pair["a"][3].T)
    np.testing.assert_array_equal(adapter[f"{prefix}.lora_B.weight"], pair["b"][3].T)


def test_one_process_of_four_devices_writes_the_whole_tensors_export(tmp_path, reference):
    report = run_probe(tmp_path, 1, 4)
    _check(report, reference, 1)
    _check_tensors(Path(report["export"]))


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory) -> tuple[Path, list[str]]:
    """2 processes x 2 devices: the export into ``out``, then, in the same processes (two
    starts fewer), into ``out/full-disk`` with process 1's writes failing as on a full disk;
    ``out`` and each process's stdout."""
    out = tmp_path_factory.mktemp("two-processes")
    (out / "full-disk").mkdir()
    argv = [str(SCRIPT), "--out", str(out), "--max-shard-size", str(MAX_SHARD_SIZE)]
    argv += ["--full-disk-in", "1", "--full-disk-out", str(out / "full-disk")]
    return out, loopback.run_all(argv, 2, 2)


@pytest.mark.parametrize(("count", "devices_each"), [(2, 2), (4, 1)])
def test_processes_write_their_slices_into_the_same_files(
    request, tmp_path, reference, count, devices_each
):
    if count == 2:
        _, outputs = request.getfixturevalue("two_processes")
        report = json.loads(outputs[0].strip().splitlines()[-1])
    else:
        report = run_probe(tmp_path, count, devices_each)
    _check(report, reference, count)


def test_a_full_disk_in_one_process_fails_the_export_in_every_process(two_processes):
    out, outputs = two_processes
    full_disk = out / "full-disk"
    for output in outputs:
        said = next(json.loads(line) for line in output.splitlines() if "full_disk_failure" in line)
        failure = said["full_disk_failure"]
        assert failure is not None, said
        assert f"export {full_disk / 'export'} was not written" in failure["message"]
        assert "failed in process(es) [1]" in failure["message"]
        # the failing process names its error and keeps it an I/O failure (exit 5)
        assert failure["io_failure"] == (said["process"] == 1), said
        if said["process"] == 1:
            assert "No space left on device" in failure["message"]
            assert "model" in failure["message"]  # the file it was writing
    assert sorted(p.name for p in full_disk.iterdir()) == []  # nothing half-written


@pytest.mark.parametrize("lora", [False, True])
def test_a_two_process_attempt_exports_what_one_process_does(tmp_path, lora):
    """The worker's end: a fine-tune of a pinned base with ``shard_params`` over 2 processes
    (full: the FP32 masters converted slice by slice; LoRA: the merged weights and the
    adapter) writes its export (BF16, in shards) together, the same files, ``model.json``
    included, as one process over 2 devices."""
    from conftest import read_events, run_worker, write_recipe
    from test_base_model import make_inputs
    from test_lora import lora_recipe
    from test_multi_process import describe, start_processes, wait_all

    root = tmp_path / "in"
    recipe = make_inputs(root)
    if lora:
        recipe = lora_recipe(root)
    recipe["training"]["data_parallel"] = {"devices": 2, "shard_params": True}
    recipe["limits"]["max_steps"] = 2
    recipe["evaluation"].update(export_dtype="bfloat16", export_max_shard_size=12_000)
    # no greedy decoding in the final evaluations: the export (model.json included) holds no
    # metric, and each of the three workers compiled a generation program for nothing checked
    recipe["evaluation"]["max_generate_examples"] = 0
    job = write_recipe(tmp_path / "recipe.json", recipe)
    run_worker(
        job=job, input_root=root, output_root=tmp_path / "one", check_codes=(0,),
        env=loopback.cpu_env(2),
    )  # fmt: skip
    procs = start_processes(
        tmp_path / "two", job=job, input_root=root, output_root=tmp_path / "two"
    )
    assert wait_all(procs) == [0, 0], describe(procs)
    job_id = recipe["job_id"]
    (one,) = (tmp_path / "one" / job_id).iterdir()
    (two,) = [p for p in (tmp_path / "two" / job_id).iterdir() if p.is_dir()]
    compiled = next(e for e in read_events(two / "events.jsonl") if e["type"] == "compiled")
    assert compiled["placement"]["sharded_arrays"] > 0
    written = _files(two / "export")
    assert sum(name.startswith("model-0") for name in written) > 2  # in shards
    assert ("adapter/adapter_model.safetensors" in written) == lora
    assert written == _files(one / "export")
    assert not list((tmp_path / "two" / job_id).glob("*/.export.partial"))
