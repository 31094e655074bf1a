"""``minifield-lm-eval``: lm-eval's command line with the ``minifield`` model registered, run
as a real process on a tiny export and the shipped generate-until task.

Reference: ``generate_until`` of the same export called in this process (tests/test_harness.py
checks that against transformers' greedy decoding); exact match by hand. Processes: slow tier.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from test_hf_export import _write_export

pytestmark = pytest.mark.slow

OFFLINE = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}


def _lm_eval(*args, cwd) -> subprocess.CompletedProcess:
    command = [os.path.join(os.path.dirname(sys.executable), "minifield-lm-eval"), *args]
    return subprocess.run(
        command, cwd=cwd, capture_output=True, text=True, timeout=600,
        env={**os.environ, **OFFLINE}, check=False,
    )  # fmt: skip


def test_a_missing_export_exits_2_with_one_line(tmp_path, repo):
    proc = _lm_eval(
        "--model", "minifield", "--model_args", f"path={tmp_path / 'nope'}",
        "--tasks", "minifield_reverse_gen", "--include_path", ".",
        cwd=repo / "data" / "harness",
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr[-2000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("minifield-lm-eval: model path ") and "model.json" in last
    assert "Traceback" not in proc.stderr


def test_a_misspelt_model_argument_exits_2_naming_it(tmp_path, repo):
    _write_export(tmp_path / "export")
    proc = _lm_eval(
        "--model", "minifield", "--model_args", f"path={tmp_path / 'export'},dtpye=float32",
        "--tasks", "minifield_reverse_gen", "--include_path", ".",
        cwd=repo / "data" / "harness",
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines()[-1] == (
        "minifield-lm-eval: unknown model argument 'dtpye' (did you mean 'dtype'?): the "
        "minifield model takes path, dtype, batch_size, add_bos_token, cache, max_gen_toks"
    )
    assert "Traceback" not in proc.stderr


def test_the_command_line_runs_the_shipped_generate_task_on_our_model(tmp_path, repo):
    from lm_eval.api.instance import Instance

    from minifield.harness.model import MinifieldLM

    _write_export(tmp_path / "export")
    proc = _lm_eval(
        "--model", "minifield", "--model_args", f"path={tmp_path / 'export'}",
        "--batch_size", "4", "--tasks", "minifield_reverse_gen", "--include_path", ".",
        "--limit", "4", "--log_samples", "--output_path", str(tmp_path / "out"),
        cwd=repo / "data" / "harness",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    (results,) = (tmp_path / "out").rglob("results_*.json")
    reported = json.loads(results.read_text())["results"]["minifield_reverse_gen"]
    docs = [
        json.loads(x) for x in (repo / "data/harness/reverse_gen.jsonl").read_text().splitlines()
    ]
    lm = MinifieldLM(path=str(tmp_path / "export"))
    settings = {"until": ["\n"], "max_gen_toks": 16}
    requests = [
        Instance("generate_until", {}, (f"reverse: {d['prompt']} ->", settings), i)
        for i, d in enumerate(docs[:4])
    ]
    outputs = lm.generate_until(requests)
    (samples,) = (tmp_path / "out").rglob("samples_minifield_reverse_gen_*.jsonl")
    logged = [json.loads(line) for line in samples.read_text().splitlines()]
    assert [s["resps"][0][0] for s in sorted(logged, key=lambda s: s["doc_id"])] == outputs
    right = sum(out == f" {d['response']}" for out, d in zip(outputs, docs, strict=False))
    assert reported["exact_match,none"] == pytest.approx(right / 4)
