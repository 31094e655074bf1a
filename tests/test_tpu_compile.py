"""``benchmarks/tpu_compile.py``: our steps compiled for a TPU v5e on a CPU host.

On CPU (CI, no libtpu): the abstract quantized base is the base ``quantize_matrix`` and
``placement.frozen_base`` really make (its leaves' shapes and dtypes, the whole stacked tree),
and the command line refuses what it cannot run, one line, exit 2. Where libtpu is installed
(``uv sync --extra tpu``): a tiny step compiled for the chip, its figures checked against the
arguments' own bytes and its kernels the chip's, not the interpreter's."""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys

import numpy as np
import pytest
from conftest import REPO

from minifield.hf import quantized_base

sys.path.insert(0, str(REPO / "benchmarks"))
try:
    import _tpu_cases
    import tpu_compile
finally:
    sys.path.remove(str(REPO / "benchmarks"))


@pytest.mark.parametrize(
    "K, N, scheme, block, double",
    [(256, 96, "nf4", 64, True), (128, 40, "nf4", 32, False), (192, 64, "int8", None, False),
     (192, 64, "int8", 64, True), (64, 600, "nf4", 64, True)],
)  # fmt: skip
def test_abstract_leaves_are_quantize_matrix_s(K, N, scheme, block, double):
    value = np.random.default_rng(0).standard_normal((N, K)).astype(np.float32)  # HF [out, in]
    made = quantized_base.quantize_matrix(value, True, scheme, block, double)
    want = {k: None if v is None else (np.shape(v), np.asarray(v).dtype) for k, v in made.items()}
    assert _tpu_cases.abstract_leaves(K, N, scheme, block, double) == want


@pytest.mark.parametrize("scheme, block, double", [("nf4", None, True), ("int8", None, False)])
def test_the_abstract_base_is_the_placed_base(tmp_path, scheme, block, double):
    """The whole tree a one-device scanned LoRA run places (the product made on the host, the
    layers stacked on the device) against :func:`_tpu_cases.abstract_base`'s."""
    import dataclasses

    import jax
    from test_qlora_base_writer import tiny

    from minifield.hf import checkpoint, stored_base
    from minifield.models.execution import Execution
    from minifield.strategies.lm import placement
    from minifield.training import lora

    cfg = tiny(layers=2, d=64, ff=128, vocab=96)
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import _qlora_base
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    _qlora_base.write_base(tmp_path, cfg)
    _, params, layout = checkpoint.map_stored(tmp_path)
    arrays = stored_base.to_arrays(params, layout)
    cfg = dataclasses.replace(
        checkpoint.map_stored(tmp_path)[0], execution=Execution(scan_layers=True)
    )
    targets = tuple(name for name, dense in lora.TARGETS.items() if dense)
    settings = lora.LoraSettings(4, 8.0, targets, "bfloat16", scheme, block, double)
    placed = placement.frozen_base(arrays, {}, settings, scan_layers=True)
    abstract = _tpu_cases.abstract_base(cfg, settings)

    def described(tree):
        leaves, structure = jax.tree_util.tree_flatten(tree)
        return structure, [(tuple(a.shape), np.dtype(a.dtype)) for a in leaves]

    assert described(abstract) == described(placed)
    assert (abstract.out_in, abstract.dtype) == (placed.out_in, placed.dtype)


def test_without_libtpu_one_line_and_exit_2(monkeypatch, capsys):
    monkeypatch.setattr(tpu_compile, "libtpu_installed", lambda: False)
    assert tpu_compile.main(["qlora", "--preset", "tiny"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "uv sync --locked --extra tpu" in err[0]


@pytest.mark.parametrize(
    "argv, named",
    [(["step", "--grad-accum-steps", "0"], "--grad-accum-steps"),
     (["qlora", "--seq", "-4"], "--seq"), (["qlora", "--loss-chunk-tokens", "-1"], "--loss"),
     (["qlora", "--mode", "fp8"], "--mode")],
)  # fmt: skip
def test_bad_arguments_are_refused(argv, named, capsys):
    with pytest.raises(SystemExit) as exited:
        tpu_compile.arguments(argv)
    assert exited.value.code == 2 and named in capsys.readouterr().err


needs_libtpu = pytest.mark.skipif(
    importlib.util.find_spec("libtpu") is None, reason="libtpu not installed (uv sync --extra tpu)"
)


@needs_libtpu
@pytest.mark.slow
def test_a_tiny_step_compiled_for_the_chip(tmp_path):
    """The tiny NF4 step with the Pallas product: compiled for the chip (a v5e's device kind),
    its kernels the chip's own (the interpreter would leave no Mosaic call), its arguments at
    least the abstract arguments' bytes, its peak the parts' sum."""
    out = tmp_path / "tiny.json"
    command = [sys.executable, str(REPO / "benchmarks/tpu_compile.py"), "qlora", "--out",
               str(out), "--hlo", str(tmp_path / "step.hlo"), "--remat", "full", "--preset",
               "tiny", "--seq", "128", "--mode", "nf4", "--kernel", "pallas"]  # fmt: skip
    run = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    record = json.loads(out.read_text())
    assert record["fits"] and record["device_kind"] == "TPU v5 lite"
    parts = record["argument_bytes"] + record["output_bytes"] + record["temp_bytes"]
    assert record["peak_bytes"] == parts - record["alias_bytes"]
    # the chip pads small arrays to its tiles: at least the arguments' own bytes
    assert record["argument_bytes"] >= record["abstract_argument_bytes"] > 0
    assert "tpu_custom_call" in (tmp_path / "step.hlo").read_text()
    assert math.isfinite(record["flops"]) and record["flops"] > 0


def test_the_compilers_refusals_are_read():
    """Both forms the TPU compiler refuses a program in (the chip's messages, 2026-12-06)."""
    temps = (
        "RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for HLO "
        "temporaries (18.12G) exceeds available HBM (15.75G)."
    )
    assert tpu_compile._temporaries(temps) == int(18.12 * 2**30)
    assert tpu_compile._temporaries("Used 16.72G of 15.75G hbm. Exceeded hbm capacity") is None
