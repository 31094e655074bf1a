import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from minifield.state import checkpoint
from minifield.state.arrays import part_hashes, state_hash


def make_state(w=1.0, step=0):
    return {
        "params": {"w": jnp.full((3,), w, jnp.float32), "b": jnp.zeros((1,), jnp.float32)},
        "opt_state": {"trace": jnp.arange(3, dtype=jnp.float32)},
        "rng": jnp.array([0, 3], jnp.uint32),
        "step": jnp.asarray(step, jnp.int32),
        "cursor": jnp.asarray(step * 8, jnp.int32),
    }


def test_state_hash_covers_every_part_and_names_the_one_that_differs():
    base = make_state()
    changed = make_state()
    changed["opt_state"]["trace"] = changed["opt_state"]["trace"].at[1].set(7.0)
    assert state_hash(base) != state_hash(changed)
    a, b = part_hashes(base), part_hashes(changed)
    assert [k for k in a if a[k] != b[k]] == ["opt_state"]
    assert state_hash(make_state()) == state_hash(base)


def test_roundtrip_keeps_scalars_shapes_and_hash(tmp_path):
    state = make_state(w=2.5, step=4)
    committed = checkpoint.save(tmp_path, state, step=4, computation_digest="c" * 64)
    restored, manifest = checkpoint.load(committed.path, make_state(), computation_digest="c" * 64)
    assert manifest["step"] == 4
    assert np.asarray(restored["step"]).shape == ()
    assert state_hash(restored) == state_hash(state) == committed.state_hash
    assert not list(tmp_path.glob(".tmp-*"))


def _first_array(path):
    manifest = json.loads((path / "manifest.json").read_text())
    return path / manifest["arrays"][0]["file"]


def test_flipped_byte_truncation_and_missing_manifest_are_detected(tmp_path):
    for step in (2, 4, 6):
        checkpoint.save(tmp_path, make_state(step=step), step=step, computation_digest="c" * 64)
    flipped = _first_array(tmp_path / "step-00000002")
    data = bytearray(flipped.read_bytes())
    data[-1] ^= 0x01
    flipped.write_bytes(bytes(data))
    truncated = _first_array(tmp_path / "step-00000004")
    truncated.write_bytes(truncated.read_bytes()[:-3])
    (tmp_path / "step-00000006" / "manifest.json").unlink()
    for step, needle in ((2, "sha256 mismatch"), (4, "sha256 mismatch"), (6, "never committed")):
        with pytest.raises(checkpoint.CheckpointError, match=needle):
            checkpoint.load(tmp_path / checkpoint.step_dir_name(step), make_state())
    assert checkpoint.committed_steps(tmp_path) == [2, 4]


def test_other_computation_is_refused(tmp_path):
    committed = checkpoint.save(tmp_path, make_state(), step=1, computation_digest="a" * 64)
    with pytest.raises(checkpoint.CheckpointError, match="belongs to computation"):
        checkpoint.load(committed.path, make_state(), computation_digest="b" * 64)


def test_non_increasing_step_is_rejected_and_retention_prunes(tmp_path):
    checkpoint.save(tmp_path, make_state(), step=2, computation_digest="c" * 64)
    for step in (2, 1):
        with pytest.raises(checkpoint.CheckpointError, match="not greater"):
            checkpoint.save(tmp_path, make_state(), step=step, computation_digest="c" * 64)
    for step in (3, 4, 5):
        checkpoint.save(tmp_path, make_state(), step=step, computation_digest="c" * 64, keep=2)
    assert checkpoint.committed_steps(tmp_path) == [4, 5]


def test_checkpoint_contains_no_pickle(tmp_path):
    state = make_state(w=1.5, step=1)
    committed = checkpoint.save(tmp_path, state, step=1, computation_digest="c" * 64)
    # One .npy per state leaf (the documented layout arrays/00000.npy ...), counted from the
    # state itself, so an empty or partial arrays directory fails here.
    leaves = jax.tree_util.tree_leaves(state)
    files = sorted((committed.path / "arrays").iterdir())
    assert [f.name for f in files] == [f"{i:05d}.npy" for i in range(len(leaves))]
    # raises if an object array / pickle were stored
    stored = [np.load(file, allow_pickle=False) for file in files]
    as_bytes = sorted((a.dtype.str, a.shape, a.tobytes()) for a in map(np.asarray, stored))
    assert as_bytes == sorted((a.dtype.str, a.shape, a.tobytes()) for a in map(np.asarray, leaves))
