"""``benchmarks/qlora_pipeline.py`` on this CPU at a tiny shape: the NF4 LoRA run through
prepare (with the quantized base's product), train (the compiled update's memory from the
worker's events), evaluate (with the selected export), publish and activate (the gate, its
re-evaluation a layer at a time), each stage's record in the JSON; the
export it writes is the merged model (``W + scale * B @ A`` from the base and adapter files,
float64 NumPy, to BF16 rounding) and the store holds it."""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest
from conftest import REPO, export_evaluated_as_started
from safetensors.numpy import load_file

sys.path.insert(0, str(REPO / "benchmarks"))
try:
    import qlora_pipeline
finally:
    sys.path.remove(str(REPO / "benchmarks"))


@pytest.mark.slow
def test_the_pipeline_runs_every_stage_and_records_it(tmp_path):
    out = tmp_path / "record.json"
    argv = ["--preset", "tiny", "--seq", "64", "--steps", "2", "--rank", "4"]
    assert qlora_pipeline.main([*argv, "--dir", str(tmp_path / "run"), "--out", str(out)]) == 0
    record = json.loads(out.read_text())
    stages = record["stages"]
    assert sorted(stages) == sorted(qlora_pipeline.STAGES)
    for name, stage in stages.items():
        assert stage["exit"] == 0 and stage["seconds"] > 0, name
        assert stage["host_peak_rss_bytes"] > 0, name
        # the parent's watch: the host's lowest available memory while it ran, never stopped
        assert stage["available_min_bytes"] > 0 and "stopped" not in stage, name
    assert stages["train"]["status"] == "completed" and stages["train"]["steps"] == 2
    # the worker compiled its update with the product's codes among its arguments
    codes = sum(
        np.load(f, mmap_mode="r").nbytes for f in (tmp_path / "run" / "quantized").glob("*.npy")
    )
    memory = stages["train"]["compiled_memory"]
    assert codes > 0 and memory["arguments"] > codes
    assert (
        stages["train"]["final_export_bytes"] > 0 and not (tmp_path / "run/train/export").exists()
    )
    assert np.isfinite(stages["evaluate"]["selected_dev"]["dev_loss"])
    run = tmp_path / "run"
    publication = json.loads((run / "publication.json").read_text())
    assert publication["content_id"] == stages["publish"]["content_id"]
    artifact = run / "store" / "artifacts" / publication["content_id"]
    assert artifact.is_dir()
    # activation's gate ran every check: the missing recovery proof is its only refusal, and
    # it re-evaluated the published export a layer at a time (the 8B path)
    activate = stages["activate"]
    assert activate["streamed"] is True
    assert [r.split(" (")[0] for r in activate["refused_for"]] == [
        "missing provenance: recovery_proof"
    ]
    assert not (run / "store" / "active.json").exists()  # refused: no pointer written
    gate = activate["reevaluation"]
    assert np.isfinite(gate["dev_loss"]) and gate["dev_generated"] == 2
    # the whole-model re-evaluation of the same files (what a small export gets): BF16
    # compute, so within BF16's unit roundoff, not bit for bit (the exact identity, and why,
    # in test_streamed_evaluation.py)
    whole = export_evaluated_as_started(run / "validated.json", artifact)
    np.testing.assert_allclose(gate["dev_loss"], whole["dev_loss"], rtol=2**-9)
    assert gate["dev_exact_match"] == whole["dev_exact_match"]
    # the selected export: the random base's tensors plus scale * B @ A where adapted
    export = run / "eval" / "selected"
    adapter = load_file(str(export / "adapter" / "adapter_model.safetensors"))
    merged = {}
    for shard in export.glob("model*.safetensors"):
        merged.update(load_file(str(shard)))
    base = {}
    for shard in (run / "in" / "base").glob("model-*.safetensors"):
        base.update(load_file(str(shard)))
    assert merged.keys() == base.keys()
    import ml_dtypes

    for name, w in base.items():
        expected = w.view(ml_dtypes.bfloat16).astype(np.float64) if w.dtype == np.uint16 else w
        expected = np.asarray(expected, np.float64)
        module = f"base_model.model.{name[: -len('.weight')]}"
        if f"{module}.lora_A.weight" in adapter:
            a = adapter[f"{module}.lora_A.weight"].astype(np.float64)
            b = adapter[f"{module}.lora_B.weight"].astype(np.float64)
            expected = expected + 2.0 * (b @ a)  # alpha 2 * rank over rank
        # the export is BF16: rounded to nearest, within 2 ** -8 relative of the exact value (and
        # the FP32 sum's own rounding before it)
        got = np.asarray(merged[name], np.float64)
        np.testing.assert_allclose(got, expected, rtol=2**-8 + 1e-6, atol=1e-30, err_msg=name)
