"""``minifield-lm-eval``: lm-eval's command line with the ``minifield`` model registered, run
as a real process on a tiny export and the shipped generate-until task; its two refusals are
run through the same ``main`` in this process.

Reference: ``generate_until`` of the same export called in this process (tests/test_harness.py
checks that against transformers' greedy decoding); exact match by hand. Processes: slow tier.
"""

from __future__ import annotations

import copy
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import main_in_process
from test_hf_export import _write_export

pytestmark = pytest.mark.slow

OFFLINE = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}


def _lm_eval(*args, cwd) -> subprocess.CompletedProcess:
    command = [os.path.join(os.path.dirname(sys.executable), "minifield-lm-eval"), *args]
    return subprocess.run(
        command, cwd=cwd, capture_output=True, text=True, timeout=600,
        env={**os.environ, **OFFLINE}, check=False,
    )  # fmt: skip


@pytest.fixture(scope="module")
def export(tmp_path_factory):
    """One tiny export every test here only reads."""
    directory = tmp_path_factory.mktemp("harness-cli") / "export"
    _write_export(directory)
    return directory


@pytest.fixture(scope="module")
def index_once():
    """lm-eval indexes all its ~14,000 built-in task YAMLs on every command (about 6 CPU-s,
    most of a refusal's cost). The refusals here are of the model's arguments, for a task of
    the ``--include_path`` directory, which lm-eval indexes after its built-in ones: they index
    that directory alone (no built-in task is named, and one of the include path would
    override a built-in of its name anyway), once, the index handed (as a copy) to the next.
    The real command below indexes everything for itself."""
    import lm_eval.tasks
    from lm_eval.tasks._index import TaskIndex

    build, built = TaskIndex.build, {}
    defaults = Path(lm_eval.tasks.__file__).parent.resolve()

    def build_once(paths, **options):
        paths = [p for p in paths if Path(p).resolve() != defaults]
        key = (tuple(str(Path(p).resolve()) for p in paths), tuple(sorted(options.items())))
        if key not in built:
            built[key] = build(paths, **options)
        return copy.deepcopy(built[key])

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(TaskIndex, "build", staticmethod(build_once))
        yield


def _lm_eval_here(monkeypatch, *args, cwd) -> subprocess.CompletedProcess:
    """``minifield-lm-eval ARGS`` through :func:`minifield.harness.cli.main` in this process
    (the process path is the real command's, below): exit code, stdout and stderr. lm-eval's
    logging is set up afresh, onto the stderr read here, and put back afterwards."""
    import lm_eval.utils

    from minifield.harness import cli

    logger = logging.getLogger("lm_eval")
    monkeypatch.setattr(logger, "handlers", [])
    monkeypatch.setattr(logger, "propagate", logger.propagate)
    monkeypatch.setattr(lm_eval.utils, "_LOGGING_CONFIGURED", False)
    monkeypatch.setattr(sys, "argv", sys.argv)  # main sets it for lm-eval's parser
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")  # set by lm-eval: put back after
    for name, value in OFFLINE.items():
        monkeypatch.setenv(name, value)
    monkeypatch.chdir(cwd)
    level = logger.level
    try:
        return main_in_process(cli.main, *args)
    finally:
        logger.setLevel(level)  # setLevel, not the attribute: it clears logging's cache


def test_a_missing_export_exits_2_with_one_line(tmp_path, repo, index_once, monkeypatch):
    proc = _lm_eval_here(
        monkeypatch,
        "--model", "minifield", "--model_args", f"path={tmp_path / 'nope'}",
        "--tasks", "minifield_reverse_gen", "--include_path", ".",
        cwd=repo / "data" / "harness",
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr[-2000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("minifield-lm-eval: model path ") and "model.json" in last
    assert "Traceback" not in proc.stderr


def test_a_misspelt_model_argument_exits_2_naming_it(export, repo, index_once, monkeypatch):
    proc = _lm_eval_here(
        monkeypatch,
        "--model", "minifield", "--model_args", f"path={export},dtpye=float32",
        "--tasks", "minifield_reverse_gen", "--include_path", ".",
        cwd=repo / "data" / "harness",
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines()[-1] == (
        "minifield-lm-eval: unknown model argument 'dtpye' (did you mean 'dtype'?): the "
        "minifield model takes path, dtype, batch_size, add_bos_token, cache, max_gen_toks"
    )
    assert "Traceback" not in proc.stderr


def test_the_command_line_runs_the_shipped_generate_task_on_our_model(tmp_path, export, repo):
    from lm_eval.api.instance import Instance

    from minifield.harness.model import MinifieldLM

    proc = _lm_eval(
        "--model", "minifield", "--model_args", f"path={export}",
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
    lm = MinifieldLM(path=str(export))
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
