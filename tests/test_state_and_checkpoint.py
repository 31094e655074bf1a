import hashlib
import io
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from checkpoint_by_hand import array_line, state_hash_by_hand, verify_checkpoint_by_hand

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
    restored, manifest = checkpoint.load(
        Path(committed.path), make_state(), computation_digest="c" * 64
    )
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
    for step, needle in ((2, "sha256 mismatch"), (4, "truncated"), (6, "never committed")):
        with pytest.raises(checkpoint.CheckpointError, match=needle):
            checkpoint.load(tmp_path / checkpoint.step_dir_name(step), make_state())
    assert checkpoint.committed_steps(tmp_path) == [2, 4]


def test_other_computation_is_refused(tmp_path):
    committed = checkpoint.save(tmp_path, make_state(), step=1, computation_digest="a" * 64)
    with pytest.raises(checkpoint.CheckpointError, match="belongs to computation"):
        checkpoint.load(Path(committed.path), make_state(), computation_digest="b" * 64)


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
    files = sorted((Path(committed.path) / "arrays").iterdir())
    assert [f.name for f in files] == [f"{i:05d}.npy" for i in range(len(leaves))]
    # raises if an object array / pickle were stored
    stored = [np.load(file, allow_pickle=False) for file in files]
    as_bytes = sorted((a.dtype.str, a.shape, a.tobytes()) for a in map(np.asarray, stored))
    assert as_bytes == sorted((a.dtype.str, a.shape, a.tobytes()) for a in map(np.asarray, leaves))


def _flat(state) -> dict:
    out = {}
    for part, value in state.items():
        for name, leaf in value.items() if isinstance(value, dict) else [(None, value)]:
            out[part if name is None else f"{part}/{name}"] = np.asarray(leaf)
    return out


def test_state_hash_v2_is_the_hash_of_the_array_hashes_recomputed_from_the_raw_files(tmp_path):
    """Version 2, as docs/training-loop.md defines it, computed by hand from the written files
    and, separately, from the state's own bytes."""
    state = make_state(w=0.75, step=3)
    committed = checkpoint.save(tmp_path, state, step=3, computation_digest="c" * 64)
    manifest, arrays = verify_checkpoint_by_hand(Path(committed.path))
    flat = _flat(state)
    assert sorted(arrays) == sorted(flat)
    expected = state_hash_by_hand(flat)
    assert manifest["state_hash"] == committed.state_hash == state_hash(state) == expected
    # the same state built again hashes the same; version 1 is another hash of it
    assert state_hash(make_state(w=0.75, step=3)) == expected
    assert state_hash(state, version=1) != expected


def _write_v1_checkpoint(directory: Path, state, step: int) -> Path:
    """A ``minifield-checkpoint/1`` checkpoint as the previous release wrote it, written here
    with ``np.save`` and the version-1 definition (sha256 over ``name|dtype|shape\n`` and
    the bytes of each array in name order; each entry's sha256 of its whole file)."""
    path = directory / checkpoint.step_dir_name(step)
    (path / "arrays").mkdir(parents=True)
    flat, whole, entries = _flat(state), hashlib.sha256(), []
    for index, name in enumerate(sorted(flat)):
        array, buffer = flat[name], io.BytesIO()
        np.save(buffer, array, allow_pickle=False)
        (path / f"arrays/{index:05d}.npy").write_bytes(buffer.getvalue())
        entries.append(
            {
                "name": name,
                "file": f"arrays/{index:05d}.npy",
                "dtype": array.dtype.str,
                "shape": list(array.shape),
                "sha256": hashlib.sha256(buffer.getvalue()).hexdigest(),
            }
        )
        whole.update(f"{array_line(name, array)}\n".encode() + array.tobytes())
    manifest = {
        "format": "minifield-checkpoint/1",
        "step": step,
        "computation_digest": "c" * 64,
        "state_hash": whole.hexdigest(),
        "arrays": entries,
        "extra": {},
    }
    (path / "manifest.json").write_text(json.dumps(manifest))
    return path


def test_a_version_1_checkpoint_is_still_read_and_verified(tmp_path):
    state = make_state(w=1.25, step=2)
    path = _write_v1_checkpoint(tmp_path, state, 2)
    restored, manifest = checkpoint.load(path, make_state(), computation_digest="c" * 64)
    assert manifest["state_hash"] == state_hash(restored, version=1)
    assert _flat(restored).keys() == _flat(state).keys()
    for name, array in _flat(state).items():
        assert np.array_equal(_flat(restored)[name], array), name
    # its check is that of format 1: a flipped byte anywhere in a file is refused
    first = _first_array(path)
    data = bytearray(first.read_bytes())
    data[-1] ^= 0x01
    first.write_bytes(bytes(data))
    with pytest.raises(checkpoint.CheckpointError, match="sha256 mismatch"):
        checkpoint.load(path, make_state())


def test_a_manifest_that_mixes_format_and_hash_version_or_a_forged_header_is_refused(tmp_path):
    v1 = _write_v1_checkpoint(tmp_path / "v1", make_state(step=1), 1)
    manifest = json.loads((v1 / "manifest.json").read_text())
    manifest["state_hash_version"] = 2
    (v1 / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(checkpoint.CheckpointError, match="state_hash_version 2, expected 1"):
        checkpoint.load(v1, make_state())
    # format 2: the .npy header is not hashed, but must say the manifest's dtype and shape
    committed = checkpoint.save(tmp_path / "v2", make_state(), step=1, computation_digest="c" * 64)
    path = Path(committed.path)
    entry = next(e for e in json.loads((path / "manifest.json").read_text())["arrays"]
                 if e["name"] == "opt_state/trace")  # fmt: skip
    file = path / entry["file"]
    file.write_bytes(file.read_bytes().replace(b"'<f4'", b"'<i4'"))
    with pytest.raises(checkpoint.CheckpointError, match="header says <i4"):
        checkpoint.load(path, make_state())
