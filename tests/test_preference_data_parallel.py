"""Preference tuning on a two-device mesh (CPU, forced host devices) is the one-device
mathematics, for each loss; the reference log-probabilities computed on the mesh are one
device's.

One process with ``XLA_FLAGS=--xla_force_host_platform_device_count=2`` (the device count is
fixed when JAX starts, so it cannot be this one: tests/preference_mesh_cases.py, run as a
script) computes the reference on the mesh (parameters replicated, and sharded) and runs two
updates of every loss on two devices (replicated) and on two devices with the parameters
sharded and two micro-batches, and the same recipes on one device (the one-device
reference and runs too: a second process would cost another start; its compiles are as
light as the mesh's); this process compares them. Each
device and micro-batch holds whole pairs (the program's batches); partial sums formed per
device and per micro-batch are another order of FP32 additions, nothing else, so:

- the reference files agree within FP32 rounding (:data:`REFERENCE_RTOL`,
  :data:`REFERENCE_ATOL`; measured 1.9e-5 at most on sums up to 35) and say which mesh
  computed them (their digest holds ``data_parallel``; the one-device address is unchanged,
  tests/test_preference_reference.py);
- every update's metrics and the DEV metrics, and the final parameters, agree within the
  tolerances of tests/preference_mesh_cases.py (measured: metrics relative 9e-6 at most,
  parameters 1.1e-6 of the largest one).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from conftest import REPO, started_xla_flags
from preference_mesh_cases import (
    LOSSES,
    MESH_RUNS,
    close_runs,
    make_mesh_inputs,
    reference_file,
)
from safetensors.numpy import load_file

# a process that compiles eight updates on a mesh: the slow tier
pytestmark = pytest.mark.slow
#: the reference files: summed log-probabilities of about -10 to -40, computed on one device and
#: with the rows split over two, where XLA:CPU vectorises the same sums in another order (the
#: logits' dot products, the log-sum-exp over the vocabulary, the sum over the answer's
#: tokens). Each reordered sum differs by its terms' FP32 roundings, 2^-24 of the sum's size
#: for every term that reaches it: 2^-16 relative allows 2^8 such terms. Measured: 1.9e-5 at
#: -32 where first run, 2.0e-5 at -8.04 on an AMD EPYC host (2.5e-6 relative: the fixed
#: 1e-5 + 1e-6 relative bound of before, copied from the first measurement, failed there).
REFERENCE_RTOL, REFERENCE_ATOL = 2**-16, 0.0


@pytest.fixture(scope="module")
def mesh_runs(tmp_path_factory):
    root = make_mesh_inputs(tmp_path_factory.mktemp("mesh") / "in")
    out = root.parent / "mesh"
    env = {
        **os.environ,
        "JAX_PLATFORMS": "cpu",
        # the session's light compile flags beside the forced count (nothing here is
        # compared to the bit with a run started otherwise: tolerances against this process)
        "XLA_FLAGS": started_xla_flags("--xla_force_host_platform_device_count=2"),
    }
    script = REPO / "tests" / "preference_mesh_cases.py"
    done = subprocess.run(
        [sys.executable, str(script), str(root), str(out)], env=env, capture_output=True
    )
    assert done.returncode == 0, done.stderr.decode()[-4000:]
    return root, out, json.loads((out / "runs.json").read_text())


@pytest.mark.parametrize("mesh", MESH_RUNS)
def test_the_reference_on_the_mesh_is_one_devices(mesh_runs, mesh):
    from minifield.strategies.preference import reference

    root, out, record = mesh_runs
    one = load_file(root / reference_file(root))
    on_mesh = dict(np.load(out / f"reference-{mesh}.npz"))
    assert one.keys() == on_mesh.keys()
    for key in one:
        held = ~np.isnan(one[key])
        assert np.array_equal(held, ~np.isnan(on_mesh[key]))
        np.testing.assert_allclose(
            on_mesh[key][held], one[key][held], rtol=REFERENCE_RTOL, atol=REFERENCE_ATOL
        )
    path = root / record["reference"][mesh]
    recorded = json.loads((path.parent / reference.RECORD_FILE).read_text())
    assert recorded["spec"]["data_parallel"] == MESH_RUNS[mesh][0]


@pytest.fixture(scope="module")
def one_device(mesh_runs):
    """Each loss's one-device run (``run`` without ``data_parallel``), made by the script
    beside the mesh runs: one process start, and its compiles light (this process's own
    would be production's)."""
    _root, out, record = mesh_runs

    def of(loss):
        one = record["one"][loss]
        return one["metrics"], one["dev"], dict(np.load(out / f"one-{loss}.npz"))

    return of


@pytest.mark.parametrize("mesh", MESH_RUNS)
@pytest.mark.parametrize("loss", LOSSES)
def test_two_devices_are_the_one_device_update(mesh_runs, one_device, loss, mesh):
    root, out, record = mesh_runs
    one = one_device(loss)
    params = dict(np.load(out / f"{loss}-{mesh}.npz"))
    runs = record["runs"][f"{loss}-{mesh}"]
    close_runs(loss, one, (runs["metrics"], runs["dev"], params))
