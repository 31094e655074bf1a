"""State-hash version 3 does not depend on the topology: the same arrays, and the same
elementwise update of them, hash alike on one device, on 4 devices of one process
(replicated and with ``shard_params``), on 2 processes × 2 devices and on 4 processes × 1
device (loopback, gloo), with no array copied whole for the hash; a checkpoint of the
sharded state holds that hash, recomputed here by hand from its raw data file.

Each run is a process of ``tests/state_hash_topology.py`` (4 forced host devices in all; 32
in the one-process run, for shards that cut pieces; 5 processes × 2 devices for pieces that
lie across processes).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import loopback
import pytest
from checkpoint_by_hand import state_hash_by_hand, verify_checkpoint_by_hand

pytestmark = pytest.mark.slow  # every test starts JAX processes

SCRIPT = Path(__file__).with_name("state_hash_topology.py")


def run_processes(count: int, devices_each: int) -> dict:
    """Process 0's report of ``count`` processes joined on loopback."""
    return loopback.run_processes([str(SCRIPT)], count, devices_each)


@pytest.fixture(scope="module")
def one_process(tmp_path_factory) -> dict:
    """1 process × 4 devices (32 visible for the pieces-cutting cases), with a checkpoint
    of the updated sharded state."""
    directory = tmp_path_factory.mktemp("state-hash") / "checkpoints"
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--checkpoint", str(directory)],
        capture_output=True,
        text=True,
        env=loopback.cpu_env(32),
        timeout=240,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_one_process_hashes_every_placement_as_one_device_without_gathering(one_process):
    report = one_process
    assert report["processes"] == 1 and report["devices"] == 32
    assert report["replicated"]["sharded"] == 0 and report["shard_params"]["sharded"] == 5
    for moment in ("before", "after"):
        hashes = {report[p][moment] for p in ("replicated", "shard_params", "one_device")}
        assert len(hashes) == 1, moment
    assert report["replicated"]["parts"] == report["shard_params"]["parts"]
    assert report["gathered_by_hashes"] == 0
    # shards that cut the pieces (5 devices, 10 values): still the one-device hash
    assert report["cut"]["hash"] == report["cut"]["one_device"]
    # 32 devices (shards of 1-2 rows, pieces of 2-4): hashed where the shards live, no gather
    many = report["thirty_two"]
    assert many["sharded"] == 3 and many["gathered"] == many["whole_copies"] == 0
    assert many["hash"] == many["one_device"] != report["one_device"]["before"]
    # the checkpoint holds that hash, recomputed by hand from its raw data file with NumPy
    path = Path(report["checkpoint"]["path"])
    manifest, stored = verify_checkpoint_by_hand(path)
    assert manifest["state_hash_version"] == 3
    assert manifest["state_hash"] == report["shard_params"]["after"]
    assert state_hash_by_hand(stored) == report["shard_params"]["after"]


def test_two_by_two_and_four_by_one_processes_hash_as_one_process(one_process):
    for count, devices_each in ((2, 2), (4, 1)):
        report = run_processes(count, devices_each)
        assert (report["processes"], report["devices"]) == (count, 4)
        assert report["shard_params"]["sharded"] == 5
        for placement in ("replicated", "shard_params", "one_device"):
            for moment in ("before", "after"):
                assert report[placement][moment] == one_process["shard_params"][moment], (
                    count,
                    placement,
                    moment,
                )
        assert report["shard_params"]["parts"] == one_process["shard_params"]["parts"]
        # the hashes exchanged digests only: no array was copied whole to any process
        assert report["gathered_by_hashes"] == 0


def test_pieces_across_processes_are_laid_out_again_not_gathered():
    """5 processes × 2 devices, a [20, 3] array in shards of 2 rows, pieces of 5: no process
    holds a whole piece, so the hash lays the array out again over the devices (runs of 10
    rows, each within a process) instead of copying it whole, and the digest is the same."""
    report = loopback.run_processes([str(SCRIPT), "--across"], 5, 2)
    assert report["gathered"] == 0
    assert report["rows_held"] == [10]  # half the array per device, not the whole
    assert report["hash"] == report["one_device"]
    assert report["digest"] == report["array_digest"]
