"""A base model's FP32 masters converted slice by slice where they are placed
(``stored_base.FP32Slices``, a full fine-tune with ``shard_params`` on a mesh): each slice is the
eagerly converted array's slice, bit for bit, and on 4 devices of 1 process or 2 × 2 processes a
process converts only its own devices' slices (``tests/base_slices_probe.py``)."""

from __future__ import annotations

import jax
import loopback
import ml_dtypes
import numpy as np
import pytest
from test_hf_shards import numpy_params

from minifield.hf import checkpoint as hf_checkpoint
from minifield.hf import stored_base
from minifield.training import data_parallel, optimizer
from minifield.training.initial_state import InitialState

SCRIPT = "base_slices_probe.py"


def _base(tmp_path):
    """A BF16 base written as an HF directory, and its prepared arrays."""
    cfg, params = numpy_params(3, qkv_bias=True)
    hf_checkpoint.write(tmp_path / "base", cfg, params, "bfloat16")
    cfg, stored, layout = hf_checkpoint.load_stored(tmp_path / "base", compute_dtype="float32")
    return tmp_path / "base", cfg, params, stored_base.to_arrays(stored, layout)


def test_every_slice_is_the_whole_conversions_slice(tmp_path):
    _, _, params, prepared = _base(tmp_path)
    eager = stored_base.host_fp32(prepared)
    lazy = stored_base.host_fp32(prepared, by_slices=True)
    pairs = list(
        zip(jax.tree_util.tree_leaves(eager), jax.tree_util.tree_leaves(lazy), strict=True)
    )
    assert any(isinstance(v, stored_base.FP32Slices) for _, v in pairs)
    for (path, original), (whole, sliced) in zip(
        jax.tree_util.tree_leaves_with_path(params), pairs, strict=True
    ):
        # the stored BF16 values widened: the FP32 parameters rounded to BF16, by ml_dtypes
        expected = original.astype(ml_dtypes.bfloat16).astype(np.float32)
        np.testing.assert_array_equal(whole, expected, err_msg=str(path))
        assert sliced.shape == whole.shape and sliced.dtype == np.float32
        np.testing.assert_array_equal(np.asarray(sliced), whole, err_msg=str(path))
        cuts = [slice(None)] * len(whole.shape)
        for axis, n in enumerate(whole.shape):
            index = tuple(cuts[:axis] + [slice(n // 3, n - 1)] + cuts[axis + 1 :])
            assert sliced[index].tobytes() == whole[index].tobytes(), (path, axis)
        placed = data_parallel.place(sliced, jax.sharding.SingleDeviceSharding(jax.devices()[0]))
        assert np.asarray(placed).tobytes() == whole.tobytes()


def test_the_state_started_from_slices_is_the_eager_one(tmp_path):
    _, cfg, _, prepared = _base(tmp_path)
    adamw = optimizer.make_optimizer({"learning_rate": 0.01, "warmup_steps": 1}, 4)
    eager = InitialState(cfg, adamw, 0, stored_base.host_fp32(prepared))
    lazy = InitialState(cfg, adamw, 0, stored_base.host_fp32(prepared, by_slices=True))
    shapes = jax.tree_util.tree_map(lambda a: (a.shape, a.dtype), lazy.abstract())
    assert shapes == jax.tree_util.tree_map(
        lambda a: (a.shape, a.dtype), jax.eval_shape(eager.on_one_device)
    )
    for a, b in zip(
        jax.tree_util.tree_leaves(eager.on_one_device()),
        jax.tree_util.tree_leaves(lazy.on_one_device()),
        strict=True,
    ):
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes()


@pytest.mark.slow  # starts JAX processes
def test_each_process_converts_only_its_slices(tmp_path):
    import json
    import subprocess
    import sys
    from pathlib import Path

    base, *_ = _base(tmp_path)
    script = str(Path(__file__).with_name(SCRIPT))
    done = subprocess.run(
        [sys.executable, script, "--base", str(base)],
        capture_output=True,
        text=True,
        env=loopback.cpu_env(4),
        timeout=240,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    one = json.loads(done.stdout.strip().splitlines()[-1])
    outputs = loopback.run_all([script, "--base", str(base)], 2, 2)
    two = [json.loads(out.strip().splitlines()[-1]) for out in outputs]
    for report in [one, *two]:
        assert report["converted_whole"] == 0 and report["lazy_leaves"] > 0
        assert report["hash"] == report["reference_hash"] == one["reference_hash"]
    # one process: each of its 4 devices asks for its slice, every element once
    assert one["converted"] == one["lazy_elements"]
    # two processes: each converts its 2 devices' slices, half the elements
    assert [r["converted"] for r in two] == [one["lazy_elements"] // 2] * 2
