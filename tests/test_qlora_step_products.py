"""``benchmarks/qlora_step.py``'s base and products in ``--dir`` (``_qlora_base.py``): each
mode's process maps the base (:func:`checkpoint.map_stored`: the values :func:`load_stored`
reads), a scheme's product holds the codes a worker without one makes, it is made once and
kept, a new base drops it; and ``--budget`` ends the call with its JSON."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
from conftest import REPO
from test_qlora_base_writer import tiny

from minifield.hf import checkpoint, quantized_base, stored_base

sys.path.insert(0, str(REPO / "benchmarks"))
try:
    import _qlora_base
finally:
    sys.path.remove(str(REPO / "benchmarks"))


@pytest.fixture
def base(tmp_path):
    cfg = tiny(layers=2, d=64, ff=128, vocab=96)
    assert _qlora_base.write_base(tmp_path, cfg) is not None
    return tmp_path


def test_the_mapped_base_is_the_read_base(base):
    cfg, read, layout = checkpoint.load_stored(base)
    mapped_cfg, mapped, mapped_layout = checkpoint.map_stored(base)
    assert (mapped_cfg, mapped_layout) == (cfg, layout)
    want, got = stored_base.to_arrays(read, layout), stored_base.to_arrays(mapped, layout)
    assert sorted(got) == sorted(want)
    for name in want:
        assert got[name].dtype == want[name].dtype and np.array_equal(got[name], want[name])


@pytest.mark.parametrize(
    ("scheme", "block", "no_double"), [("int8", None, True), ("nf4", 16, False)]
)
def test_a_product_holds_the_codes_made_without_one_and_is_made_once(
    base, scheme, block, no_double
):
    found = _qlora_base.settings(scheme, block, no_double)
    assert _qlora_base.make_product(base, found) is not None
    assert _qlora_base.make_product(base, found) is None  # kept: the kernels share it
    arrays = _qlora_base.arrays(base, 16, found)
    _, params, layout = checkpoint.load_stored(base)
    matrices = 0
    for path, value, out_in in stored_base.stored(stored_base.to_arrays(params, layout)):
        if value.ndim != 2 or not path.startswith("blocks/"):
            continue
        made = quantized_base.quantize_matrix(value, out_in, *found)
        for leaf in quantized_base.LEAVES:
            name = f"{quantized_base.PREFIX}{path.replace('/', '.')}.{leaf}"
            if made[leaf] is None:
                assert name not in arrays
            else:
                assert np.array_equal(np.asarray(arrays[name]), made[leaf]), name
        matrices += 1
    assert matrices == 2 * 7


def test_a_new_base_drops_the_products_of_the_old(base):
    found = _qlora_base.settings("int8", None, True)
    _qlora_base.make_product(base, found)
    (base / checkpoint.CONFIG_FILE).unlink()  # an unfinished base: written again
    assert _qlora_base.write_base(base, tiny(layers=2, d=64, ff=128, vocab=96)) is not None
    assert not _qlora_base.product_dir(base, found).exists()


@pytest.mark.slow
def test_a_call_out_of_its_budget_ends_with_its_json(tmp_path):
    """A budget of 0: the base is written (the budget bounds the modes), no mode runs, and the
    JSON names each one's reason."""
    out = tmp_path / "q.json"
    command = [sys.executable, str(REPO / "benchmarks" / "qlora_step.py"), "--preset", "tiny",
               "--seq", "16", "--dir", str(tmp_path / "base"), "--kernels", "xla", "pallas",
               "--budget", "0", "--out", str(out)]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    report = json.loads(out.read_text())
    assert report["results"] == {}
    assert sorted(report["failed"]) == ["bf16", "int8/pallas", "int8/xla", "nf4/pallas", "nf4/xla"]
    assert report["failed"]["bf16"] == "not run: out of the budget"
    assert (tmp_path / "base" / checkpoint.CONFIG_FILE).is_file()
