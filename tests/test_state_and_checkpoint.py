import hashlib
import io
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from checkpoint_by_hand import (
    array_line,
    pieces_digest_by_hand,
    rewrite_as_format_3,
    state_hash_by_hand,
    verify_checkpoint_by_hand,
)

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
    """A format-1/2 checkpoint's first array file."""
    manifest = json.loads((path / "manifest.json").read_text())
    return path / manifest["arrays"][0]["file"]


def _flip_byte(file: Path, offset: int) -> None:
    data = bytearray(file.read_bytes())
    data[offset] ^= 0x01
    file.write_bytes(bytes(data))


def test_flipped_byte_truncation_and_missing_manifest_are_detected(tmp_path):
    for step in (2, 4, 6, 8, 10):
        checkpoint.save(tmp_path, make_state(step=step), step=step, computation_digest="c" * 64)
    # a format-3 checkpoint (each array's sha256) as earlier releases wrote it
    rewrite_as_format_3(tmp_path / "step-00000010")
    _flip_byte(tmp_path / "step-00000010" / "arrays.bin", 64 + 5)
    # a byte of opt_state/trace (the 2nd array in name order), found from the manifest
    manifest = json.loads((tmp_path / "step-00000002" / "manifest.json").read_text())
    entry = next(e for e in manifest["arrays"] if e["name"] == "opt_state/trace")
    _flip_byte(tmp_path / "step-00000002" / "arrays.bin", entry["offset"] + 5)
    truncated = tmp_path / "step-00000004" / "arrays.bin"
    truncated.write_bytes(truncated.read_bytes()[:-3])
    (tmp_path / "step-00000006" / "manifest.json").unlink()
    # padding between two arrays (cursor is 4 bytes at offset 0; the next starts at 64)
    _flip_byte(tmp_path / "step-00000008" / "arrays.bin", 10)
    for step, needle in (
        (2, "arrays.bin: digest mismatch for state array 'opt_state/trace' .bytes 64-76."),
        (10, "arrays.bin: sha256 mismatch for state array 'opt_state/trace' .bytes 64-76."),
        (4, "arrays.bin: truncated or extended: 321 bytes, the manifest says 324"),
        (6, "never committed"),
        (8, "arrays.bin: non-zero bytes before state array 'opt_state/trace'"),
    ):
        with pytest.raises(checkpoint.CheckpointError, match=needle):
            checkpoint.load(tmp_path / checkpoint.step_dir_name(step), make_state())
    assert checkpoint.committed_steps(tmp_path) == [2, 4, 8, 10]


@pytest.mark.parametrize(
    ("field", "value", "needle"),
    [
        ("offset", 65, r"arrays\[1\] \('opt_state/trace'\): offset 65 must be a multiple of 64"),
        ("offset", 0, r"arrays\[1\] \('opt_state/trace'\): offset 0 must be .* end \(4\)"),
        ("nbytes", 8, r"arrays\[1\] \('opt_state/trace'\): nbytes 8 is not the size of <f4\[3\]"),
        ("dtype", "|O", r"arrays\[1\] \('opt_state/trace'\): dtype \|O holds Python objects"),
        ("shape", [4], r"arrays\[1\] .*: nbytes 12 is not the size of <f4\[4\] \(16\)"),
    ],
)
def test_a_format_5_manifest_whose_layout_is_wrong_is_refused_naming_the_field(
    tmp_path, field, value, needle
):
    committed = checkpoint.save(tmp_path, make_state(), step=1, computation_digest="c" * 64)
    manifest_path = Path(committed.path) / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    assert manifest["arrays"][1]["name"] == "opt_state/trace"
    manifest["arrays"][1][field] = value
    manifest_path.write_text(json.dumps(manifest))
    with pytest.raises(checkpoint.CheckpointError, match=f"manifest.json: {needle}"):
        checkpoint.load(Path(committed.path), make_state())


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


def test_checkpoint_is_one_data_file_and_a_manifest_holding_every_leaf(tmp_path):
    state = make_state(w=1.5, step=1)
    committed = checkpoint.save(tmp_path, state, step=1, computation_digest="c" * 64)
    path = Path(committed.path)
    assert sorted(p.name for p in path.iterdir()) == ["arrays.bin", "manifest.json"]
    # every state leaf, cut from the raw data file by hand (no pickle: plain bytes at offsets)
    manifest, stored = verify_checkpoint_by_hand(path)
    assert manifest["format"] == "minifield-checkpoint/5"
    leaves = jax.tree_util.tree_leaves(state)
    as_bytes = sorted((a.dtype.str, a.shape, a.tobytes()) for a in stored.values())
    assert as_bytes == sorted((a.dtype.str, a.shape, a.tobytes()) for a in map(np.asarray, leaves))
    # the documented layout, by hand: cursor (4 bytes) at 0, each next array at 64 bytes on
    assert [(e["name"], e["offset"], e["nbytes"]) for e in manifest["arrays"]] == [
        ("cursor", 0, 4),
        ("opt_state/trace", 64, 12),
        ("params/b", 128, 4),
        ("params/w", 192, 12),
        ("rng", 256, 8),
        ("step", 320, 4),
    ]


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
    _flip_byte(_first_array(path), -1)
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
    path = tmp_path / "v2"
    shutil.copytree(STORED_V2, path)
    entry = next(e for e in json.loads((path / "manifest.json").read_text())["arrays"]
                 if e["name"] == "opt_state/trace")  # fmt: skip
    file = path / entry["file"]
    file.write_bytes(file.read_bytes().replace(b"'<f4'", b"'<i4'"))
    with pytest.raises(checkpoint.CheckpointError, match="header says <i4"):
        checkpoint.load(path, make_state())


#: a format-2 checkpoint of ``make_state(w=0.75, step=3)`` written by the previous release
STORED_V2 = Path(__file__).parent / "data" / "checkpoint-format-2" / "step-00000003"


def test_a_stored_format_2_checkpoint_is_read_and_saved_again_as_format_5_with_its_hashes(
    tmp_path,
):
    """The stored checkpoint's version-2 hash, its state rebuilt here and recomputed by hand
    agree; a format-5 commit of what was restored holds the version-3 digests and state hash
    of the same arrays, recomputed by hand from the format-2 files and from the raw file."""
    manifest_v2, by_hand = verify_checkpoint_by_hand(STORED_V2)
    assert manifest_v2["format"] == "minifield-checkpoint/2"
    restored, manifest = checkpoint.load(STORED_V2, make_state(), computation_digest="c" * 64)
    expected = state_hash_by_hand(_flat(make_state(w=0.75, step=3)), 2)
    assert manifest["state_hash"] == state_hash(restored, version=2) == expected
    assert state_hash_by_hand(by_hand, 2) == expected
    again = checkpoint.save(tmp_path, restored, step=4, computation_digest="c" * 64)
    manifest_v3, stored = verify_checkpoint_by_hand(Path(again.path))
    assert manifest_v3["format"] == "minifield-checkpoint/5"
    assert manifest_v3["state_hash_version"] == 3
    assert again.state_hash == state_hash_by_hand(by_hand) == state_hash(restored)
    assert again.state_hash == state_hash_by_hand(stored)
    digests = {name: pieces_digest_by_hand(array) for name, array in by_hand.items()}
    assert {e["name"]: e["digest"] for e in manifest_v3["arrays"]} == digests
    # a flipped byte in its .npy data is refused naming the file and the array
    copy = tmp_path / "v2"
    shutil.copytree(STORED_V2, copy)
    entry = next(e for e in manifest_v2["arrays"] if e["name"] == "params/w")
    _flip_byte(copy / entry["file"], -1)
    with pytest.raises(
        checkpoint.CheckpointError, match="sha256 mismatch for state array 'params/w'"
    ):
        checkpoint.load(copy, make_state())


_WRITER = """
import sys
import numpy as np
from pathlib import Path
from minifield.state import checkpoint
state = {"params": {"a": np.full((int(sys.argv[2]),), 3.0, np.float32)}, "step": np.int32(2)}
checkpoint.save(Path(sys.argv[1]), state, step=2, computation_digest="c" * 64)
"""


@pytest.mark.slow  # a real process, killed while it writes
def test_a_process_killed_while_writing_the_data_file_leaves_the_previous_checkpoint(tmp_path):
    state = make_state(w=0.5, step=1)
    previous = checkpoint.save(tmp_path, state, step=1, computation_digest="c" * 64)
    count = 64 << 20  # 256 MB of float32: the write takes many polls
    proc = subprocess.Popen([sys.executable, "-c", _WRITER, str(tmp_path), str(count)])
    data = tmp_path / f".tmp-step-00000002-{proc.pid}" / "arrays.bin"
    try:
        while not (data.is_file() and data.stat().st_size > 0):
            assert proc.poll() is None, "the writer ended before it wrote anything"
            time.sleep(0.001)
        os.kill(proc.pid, signal.SIGSTOP)  # frozen mid-write: what a kill leaves
        written = data.stat().st_size
        assert 0 < written < 4 * count, written
        assert not (data.parent / "manifest.json").exists()
    finally:
        proc.kill()
        proc.wait()
    assert checkpoint.committed_steps(tmp_path) == [1]
    restored, _ = checkpoint.load(Path(previous.path), make_state(), computation_digest="c" * 64)
    assert state_hash(restored) == state_hash_by_hand(_flat(state)) == previous.state_hash
    # the next commit clears the half-written temporary (prune) and succeeds
    checkpoint.save(tmp_path, state, step=3, computation_digest="c" * 64, keep=2)
    assert checkpoint.committed_steps(tmp_path) == [1, 3] and not list(tmp_path.glob(".tmp-*"))


@pytest.mark.parametrize(("rewrite", "field"), [(None, "digest"), (rewrite_as_format_3, "sha256")])
def test_an_entry_without_its_check_is_refused_naming_the_field(tmp_path, rewrite, field):
    """Format 5's entries need their digest, format 3's their sha256."""
    committed = checkpoint.save(tmp_path, make_state(), step=1, computation_digest="c" * 64)
    if rewrite is not None:
        rewrite(Path(committed.path))
    manifest_path = Path(committed.path) / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    del manifest["arrays"][2][field]
    manifest_path.write_text(json.dumps(manifest))
    with pytest.raises(checkpoint.CheckpointError, match=rf"arrays\[2\]: needs name, .*{field}"):
        checkpoint.load(Path(committed.path), make_state())


def test_a_format_3_checkpoint_of_version_3_is_read_and_verified(tmp_path):
    """As earlier releases wrote it (each array's sha256, a version-3 state hash)."""
    state = make_state(w=0.5, step=2)
    committed = checkpoint.save(tmp_path, state, step=2, computation_digest="c" * 64)
    rewrite_as_format_3(Path(committed.path))
    restored, manifest = checkpoint.load(Path(committed.path), make_state())
    assert manifest["format"] == "minifield-checkpoint/3"
    assert manifest["state_hash"] == state_hash_by_hand(_flat(restored)) == state_hash(state)


def test_a_commit_given_the_updates_digests_records_them_and_hashes_nothing_more(tmp_path):
    """At a hashed update the commit's per-array checks are the digests the update computed:
    given wrong ones (here, those of another state), it records them as they are, and the
    reader refuses the checkpoint, naming the first array whose bytes do not match."""
    state, other = make_state(w=1.0, step=1), make_state(w=2.0, step=1)
    wrong = {name: pieces_digest_by_hand(array) for name, array in _flat(other).items()}
    committed = checkpoint.save(
        tmp_path, state, step=1, computation_digest="c" * 64, known_digests=wrong
    )
    manifest = json.loads((Path(committed.path) / "manifest.json").read_text())
    assert {e["name"]: e["digest"] for e in manifest["arrays"]} == wrong
    assert committed.state_hash == state_hash_by_hand(_flat(other))
    with pytest.raises(
        checkpoint.CheckpointError, match="arrays.bin: digest mismatch for state array 'params/w'"
    ):
        checkpoint.load(Path(committed.path), make_state())


def test_the_proof_compares_two_checkpoints_part_by_part_by_the_hash_both_record(tmp_path):
    """The proof names the state parts that differ between two checkpoints from their
    manifests' per-array hashes: the sha256 that formats 2 and 3 share, the digest of
    format 5; a format-3 and a format-5 checkpoint share none (parts unknown)."""
    from minifield.proof.comparison import _manifest_part_diff

    def save(where, state):
        return Path(checkpoint.save(where, state, step=3, computation_digest="c" * 64).path)

    moved = make_state(w=0.75, step=3)
    moved["params"]["b"] = moved["params"]["b"] + 1.0
    same, other = save(tmp_path / "a", make_state(w=0.75, step=3)), save(tmp_path / "b", moved)
    assert _manifest_part_diff(same, other) == ["params"]
    same_3, other_3 = save(tmp_path / "c", make_state(w=0.75, step=3)), save(tmp_path / "d", moved)
    rewrite_as_format_3(same_3)
    rewrite_as_format_3(other_3)
    assert _manifest_part_diff(STORED_V2, same_3) == []
    assert _manifest_part_diff(STORED_V2, other_3) == ["params"]
    assert _manifest_part_diff(same_3, same) is None


def _every_hashing_path():
    """Arrays that take each way a commit hashes them (checkpoint_data.write): version-3
    digests on the hashing threads (two arrays of pieces of at least 64 KiB) and on the one
    thread beside them (smaller pieces), one piece (its digest from the sha256 of its bytes,
    hashed on the chunks written), more than one gathered write, a scalar, an empty array, a
    2-byte dtype."""
    rng = np.random.default_rng(7)
    return {
        "params": {
            "big": jnp.asarray(rng.standard_normal((1024, 768), np.float32)),
            "large": jnp.asarray(rng.standard_normal((48 * 16384,), np.float32)),
            "large_rows": jnp.asarray(rng.standard_normal((4, 16411), np.float32)),
            "one_piece": jnp.asarray(rng.standard_normal((262147,), np.float32)),
            "small": jnp.asarray(rng.standard_normal((96, 130), np.float32)),
            "odd": jnp.asarray(rng.standard_normal((7,), np.float32)),
            "half": jnp.asarray(rng.standard_normal((48, 48, 4)).astype(np.float16)),
            "empty": jnp.zeros((0, 5), jnp.float32),
        },
        "step": jnp.asarray(3, jnp.int32),
    }


def test_a_commit_hashing_while_it_writes_gives_what_the_definitions_give(tmp_path, monkeypatch):
    """Each array's version-3 digest, hashed while the data file is written (on the hashing
    threads, and on the writing thread for one piece), matches the definition recomputed by
    hand from the raw file; the device state, its host copy and a commit given the update's
    digests write the same bytes (here in gathered writes of up to 1 MiB, so a large array
    takes several; the other tests commit with the default 64 MiB)."""
    from minifield.state import checkpoint_data
    from minifield.state.arrays import array_digests, named_arrays

    monkeypatch.setattr(checkpoint_data, "_BATCH", 1 << 20)
    state = _every_hashing_path()
    host = named_arrays(state)
    assert sum(a.nbytes for a in host.values()) > 4 << 20  # more than one gathered write
    commits = {
        "device": checkpoint.save(tmp_path / "a", state, step=3, computation_digest="c" * 64),
        "host": checkpoint.save(tmp_path / "b", host, step=3, computation_digest="c" * 64),
        "known": checkpoint.save(
            tmp_path / "c", host, step=3, computation_digest="c" * 64,
            known_digests=array_digests(host),
        ),
    }  # fmt: skip
    manifest, _ = verify_checkpoint_by_hand(Path(commits["device"].path))
    assert (
        manifest["state_hash"] == state_hash_by_hand(_flat(state)) == commits["device"].state_hash
    )
    files = {
        name: [(Path(c.path) / f).read_bytes() for f in ("arrays.bin", "manifest.json")]
        for name, c in commits.items()
    }
    assert files["device"] == files["host"] == files["known"]


def test_a_write_that_fails_while_arrays_are_hashed_on_threads_leaves_no_trace(
    tmp_path, monkeypatch
):
    """A gathered write fails (a full disk) after arrays were handed to the hashing
    threads: the error names the data file, the temporary directory is removed, the
    previous checkpoint is the newest and no hashing thread is left running."""
    import threading

    from minifield.state import checkpoint_data

    state = _every_hashing_path()
    previous = checkpoint.save(tmp_path, state, step=1, computation_digest="c" * 64)

    def failing(fd, buffers):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(checkpoint_data, "_write_all", failing)
    threads = threading.active_count()
    with pytest.raises(OSError, match=r"arrays\.bin.*No space left|No space left.*arrays\.bin"):
        checkpoint.save(tmp_path, state, step=2, computation_digest="c" * 64)
    assert threading.active_count() == threads
    assert sorted(p.name for p in tmp_path.iterdir()) == [Path(previous.path).name]
    assert checkpoint.committed_steps(tmp_path) == [1]


def test_a_commit_hashes_every_array_before_the_writer_reaches_it(tmp_path, monkeypatch):
    """Every array's digest (one-piece arrays excepted: the writer hashes their chunks) is
    started as the array reaches the host, not at the writer's turn: here the first write
    waits until every such digest has started, which a commit that started each at its turn
    never reaches (it would time out); the checkpoint's digests are the definition's."""
    import threading

    from minifield.state import checkpoint_data, pieces
    from minifield.state.arrays import named_arrays

    state = _every_hashing_path()
    multi = [
        name
        for name, a in named_arrays(state).items()
        if a.size and math.prod(pieces.piece_grid(a.shape)) > 1
    ]
    started, all_started = [], threading.Event()
    start = checkpoint_data._Digests.start

    def counting(self, name, array):
        start(self, name, array)
        started.append(name)
        if len(started) == len(multi):
            all_started.set()

    write_all = checkpoint_data._write_all
    waited = []

    def first_waits(fd, buffers):
        if not waited:
            waited.append(all_started.wait(timeout=20))
        write_all(fd, buffers)

    monkeypatch.setattr(checkpoint_data._Digests, "start", counting)
    monkeypatch.setattr(checkpoint_data, "_write_all", first_waits)
    monkeypatch.setattr(checkpoint_data, "_BATCH", 1 << 20)  # the first write comes early
    ahead = checkpoint.save(tmp_path / "a", state, step=3, computation_digest="c" * 64)
    assert waited == [True] and sorted(started) == sorted(multi)
    manifest, _ = verify_checkpoint_by_hand(Path(ahead.path))
    assert manifest["state_hash"] == state_hash_by_hand(_flat(state)) == ahead.state_hash


def test_a_commit_copies_every_array_to_the_host_before_it_writes(tmp_path, monkeypatch):
    """The whole state reaches the host before the data file is opened: every array's copy
    (``to_host``) is taken before the first write (copying beside the hashing and the
    writes was the slower commit on the chip); the checkpoint is the definition's."""
    from minifield.state import arrays, checkpoint_data

    state = _every_hashing_path()
    events = []
    to_host = checkpoint.to_host

    def copying(leaf):
        events.append("copy")
        return to_host(leaf)

    write_all = checkpoint_data._write_all

    def writing(fd, buffers):
        events.append("write")
        write_all(fd, buffers)

    monkeypatch.setattr(checkpoint, "to_host", copying)
    monkeypatch.setattr(checkpoint_data, "_write_all", writing)
    monkeypatch.setattr(checkpoint_data, "_BATCH", 1 << 20)  # several writes
    record = checkpoint.save(tmp_path, state, step=1, computation_digest="c" * 64)
    copies = len(arrays.named_leaves(state))
    assert events[:copies] == ["copy"] * copies and events.count("copy") == copies
    assert events.count("write") > 1
    manifest, _ = verify_checkpoint_by_hand(Path(record.path))
    assert manifest["state_hash"] == state_hash_by_hand(_flat(state)) == record.state_hash
