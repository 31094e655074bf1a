"""State-hash version 3 (``state/pieces.py``): each array hashed in canonical pieces that any
data-parallel shard of it holds whole, checked against an independent NumPy recomputation
(``checkpoint_by_hand``: every piece cut with plain slices). The topology runs (4 devices,
2 × 2 and 4 × 1 processes) are in ``test_state_hash_topology.py``."""

from __future__ import annotations

import copy
import hashlib
import json
import math
from pathlib import Path

import numpy as np
import pytest
from checkpoint_by_hand import (
    pieces_digest_by_hand,
    rewrite_as_format_3,
    state_hash_by_hand,
    verify_checkpoint_by_hand,
)

from minifield.proof import verdict as verdicts
from minifield.state import arrays, checkpoint, pieces, regions

PROOF = Path(__file__).parent / "data" / "proofs" / "linear-demo-both.json"
SHAPES = [(), (1,), (7,), (8,), (0, 3), (24, 8), (3, 12), (2, 8, 4), (384, 5), (6, 4, 10, 2)]


def _array(shape, dtype, seed=0):
    values = np.random.default_rng(seed).standard_normal(shape) * 100
    return values.astype(dtype)


@pytest.mark.parametrize("dtype", [np.float32, np.int64, np.bool_, np.float16])
def test_array_digests_equal_the_hand_computed_pieces(dtype):
    for shape in SHAPES:
        value = _array(shape, dtype)
        assert pieces.array_digest(value) == pieces_digest_by_hand(value), shape
    # the grid of the definition: gcd(n, 48) pieces along an axis of size n
    assert pieces.piece_grid((384, 5, 36, 0)) == (1, 1, 1, 1)
    assert pieces.piece_grid((384, 5, 36)) == (48, 1, 12)
    assert pieces.piece_grid(()) == ()


def test_each_way_of_cutting_and_each_thread_give_the_hand_computed_digests():
    """Small pieces reordered by one copy (a block up to ``WHOLE_COPY``) or a row of pieces at
    a time (larger), pieces of at least ``LARGE_PIECE`` one at a time; arrays of such large
    pieces on the hashing threads while this thread hashes the others, those of pieces that
    hashlib hashes without the GIL (2 KiB and more) included (two arrays of large pieces, so
    the threads run): every digest is the hand-computed one, for the state hash and for
    version 2."""
    shapes = {
        "whole_copy": (24, 8),  # 192 pieces of 4 bytes, one copy
        "rows": (768, 384),  # 1.2 MB > WHOLE_COPY: 48 rows of 48 pieces of 512 bytes
        "large": (48 * 16384,),  # 3.1 MB: 48 pieces of 64 KB, one at a time, on a thread
        "large_rows": (4, 16411),  # 263 KB: 4 pieces of 65,644 bytes, on a thread
        # 6.6 MB: 96 pieces of 256 x 67 (68,608 bytes), columns cut: each copied into the
        # hashing thread's scratch buffer, reused from piece to piece
        "large_cols": (12288, 134),
        "mid": (5, 7, 100),  # 14 KB: 4 pieces of 3,500 bytes, without the GIL, on this thread
        "small": (7,),
    }
    flat = {
        name: _array(shape, np.float32, seed) for seed, (name, shape) in enumerate(shapes.items())
    }
    ways = {
        name: (
            value.nbytes > pieces.WHOLE_COPY,
            value.nbytes // math.prod(pieces.piece_grid(value.shape)),
        )
        for name, value in flat.items()
    }
    assert ways["whole_copy"][0] is False and ways["rows"] == (True, 512)
    assert (
        ways["large"][1] == pieces.LARGE_PIECE
        and ways["large_rows"][1] == 65644
        and ways["large_cols"][1] == 68608
        and ways["mid"][1] == 3500
        and ways["small"][1] == 28
    )
    # hashlib hashes a call of at least 2,048 bytes without the GIL (HASHLIB_GIL_MINSIZE)
    gil_free = [n for n, (_, piece) in ways.items() if piece >= 2048]
    assert sorted(gil_free) == ["large", "large_cols", "large_rows", "mid"]
    threaded = [
        n for n, v in flat.items() if pieces.pooled(v.nbytes, math.prod(pieces.piece_grid(v.shape)))
    ]
    assert threaded == ["large", "large_rows", "large_cols"]
    digests = pieces.host_digests(flat)
    assert digests == {name: pieces_digest_by_hand(value) for name, value in flat.items()}
    assert arrays.hashes_of(flat)[0] == state_hash_by_hand(flat)
    assert arrays.state_hash(flat) == state_hash_by_hand(flat)  # state_digests' jobs
    assert arrays.array_digests(flat, version=2) == {
        name: hashlib.sha256(value.tobytes()).hexdigest() for name, value in flat.items()
    }


def test_a_state_hash_is_its_hand_computed_version_3_and_differs_from_2():
    state = {
        "params": {"w": _array((24, 8), np.float32), "b": _array((8,), np.float32, 1)},
        "opt_state": {"mu": _array((3, 12), np.float32, 2)},
        "step": np.int32(4),
    }
    flat = arrays.named_arrays(state)
    whole, parts = arrays.hashes(state)
    assert whole == arrays.state_hash(state) == state_hash_by_hand(flat)
    assert parts["params"] == state_hash_by_hand({n: a for n, a in flat.items() if "params" in n})
    assert arrays.state_hash(state, version=2) == state_hash_by_hand(flat, 2) != whole
    assert arrays.hashes_of(flat) == (whole, parts)


@pytest.mark.parametrize("shape", [(24, 8), (3, 12), (2, 8, 4), (8,), (384, 5)])
def test_every_shard_a_mesh_can_make_holds_whole_pieces(shape):
    """For every device count N dividing both an axis and 48, the N shards along that axis
    hash their own pieces; put where their pieces are, those digests are the array's."""
    value = _array(shape, np.float32)
    grid = pieces.piece_grid(shape)
    expected = pieces.block_digests(value, grid)
    for axis, n in enumerate(shape):
        for devices in (d for d in range(2, n + 1) if n % d == 0 and 48 % d == 0):
            table = np.zeros((math.prod(grid), 32), np.uint8)
            numbering = np.arange(math.prod(grid)).reshape(grid)
            per = grid[axis] // devices
            for k in range(devices):
                cut = [slice(None)] * len(shape)
                cut[axis] = slice(k * n // devices, (k + 1) * n // devices)
                counts = list(grid)
                counts[axis] = per
                digests = pieces.block_digests(value[tuple(cut)], counts)
                cut[axis] = slice(k * per, (k + 1) * per)
                flat = numbering[tuple(cut)].reshape(-1)
                table[flat] = np.frombuffer(digests, np.uint8).reshape(-1, 32)
            assert table.tobytes() == expected, (axis, devices)


def test_a_format_3_checkpoint_of_the_previous_release_is_read_and_verified(tmp_path):
    """Format 3 as the previous release wrote it (a version-2 state hash) is still read;
    a version it never held, or a version-3 hash in format 2 or a version-2 one in format 5,
    is refused."""
    state = {"params": {"w": _array((24, 8), np.float32)}, "step": np.int32(2)}
    committed = checkpoint.save(tmp_path, state, step=2, computation_digest="c" * 64)
    path = Path(committed.path)
    rewrite_as_format_3(path)
    manifest, stored = verify_checkpoint_by_hand(path)
    assert manifest["state_hash_version"] == 3
    previous = {**manifest, "state_hash": state_hash_by_hand(stored, 2), "state_hash_version": 2}
    (path / "manifest.json").write_text(json.dumps(previous))
    restored, read = checkpoint.load(path, state, computation_digest="c" * 64)
    assert read["state_hash"] == arrays.state_hash(restored, version=2)
    assert arrays.state_hash(restored) == committed.state_hash
    for fmt, version in (
        ("minifield-checkpoint/3", 1),
        ("minifield-checkpoint/2", 3),
        ("minifield-checkpoint/5", 2),
    ):
        (path / "manifest.json").write_text(
            json.dumps({**manifest, "format": fmt, "state_hash_version": version})
        )
        with pytest.raises(checkpoint.CheckpointError, match=f"state_hash_version {version}"):
            checkpoint.load(path, state)
    # a version-2 hash recorded as version 3 does not verify
    (path / "manifest.json").write_text(json.dumps({**previous, "state_hash_version": 3}))
    with pytest.raises(checkpoint.CheckpointError, match="state hash differs"):
        checkpoint.load(path, state)


def test_a_proof_mixing_versions_2_and_3_is_refused():
    proof = json.loads(PROOF.read_text())
    for section in (proof, proof["preempted"]):
        section["resumed"]["state_hash_version"] = 3
        section["resumed"]["restored"]["state_hash_version"] = 3
        section["checkpoint_used"]["state_hash_version"] = 3
    proof["reference"]["state_hash_version"] = 3
    assert verdicts.verdict(proof, proof["computation_digest"]) == []
    mixed = copy.deepcopy(proof)
    mixed["resumed"]["restored"]["state_hash_version"] = 2
    (reason, *_rest) = verdicts.verdict(mixed, proof["computation_digest"])
    assert reason == (
        "crash: the state hashes are of different versions (the reference 3, the resumed run "
        "3, its restored checkpoint 2, the checkpoint used 3): hashes of two versions never "
        "agree, so this proof compares nothing; prove again with one minifield version"
    )


class _Device:
    def __init__(self, number: int, process_index: int):
        self.id, self.process_index = number, process_index


class _Shard:
    def __init__(self, device, index, data):
        self.device, self.index, self.data = device, index, data


class _Laid:
    """A host array laid out as a sharding would lay it over simulated devices (JAX's
    ``Sharding`` and ``Array`` attributes the hashing reads), seen from process ``here``:
    mesh axis ``k`` of ``mesh`` (devices along it) splits array axis ``axes[k]`` (None:
    that mesh axis replicates); ``per_process`` consecutive devices make a process."""

    def __init__(self, value, mesh, axes, per_process, here):
        self.value, self.shape, self.dtype = value, value.shape, value.dtype
        devices = [_Device(i, i // per_process) for i in range(math.prod(mesh))]
        self.device_set = set(devices)
        self.index_map = {}
        for device, at in zip(devices, np.ndindex(*mesh), strict=True):
            index = [slice(None)] * value.ndim
            for count, k, axis in zip(mesh, at, axes, strict=True):
                if axis is not None:
                    n = value.shape[axis]
                    index[axis] = slice(k * n // count, (k + 1) * n // count)
            self.index_map[device] = tuple(index)
        self.sharding = self
        self.addressable_shards = [
            _Shard(d, i, value[i]) for d, i in self.index_map.items() if d.process_index == here
        ]

    def devices_indices_map(self, shape):
        assert tuple(shape) == self.shape
        return self.index_map


def _hashed_in_place(state: dict, mesh, axes_of: dict, per_process: int) -> dict[str, str]:
    """The digests every simulated process computes of the pieces dealt to it, from its own
    shards only, combined by the owners' table as the exchange does; refuses a gather."""

    def no_gather(leaf):
        raise AssertionError(f"an array of {leaf.shape} was gathered")

    processes = math.prod(mesh) // per_process
    names = sorted(state)
    tables, owners = [], None
    for here in range(processes):
        leaves = [(n, _Laid(state[n], mesh, axes_of[n], per_process, here)) for n in names]
        offsets, owners, jobs = pieces.dealt(leaves, no_gather, here)
        table = np.zeros((sum(c for _, c in offsets), 32), np.uint8)
        for start, counts, flat, block in jobs:
            digests = pieces.block_digests(np.asarray(block), counts)
            table[start + flat] = np.frombuffer(digests, np.uint8).reshape(-1, 32)
        tables.append(table)
    rows = np.arange(len(tables[0]))
    table = np.stack(tables)[np.concatenate(owners), rows]
    return {
        name: hashlib.sha256(table[start : start + count].tobytes()).hexdigest()
        for name, (start, count) in zip(names, offsets, strict=True)
    }


@pytest.mark.parametrize("devices", [32, 64, 128, 256])
def test_shards_that_cut_pieces_hash_in_place_at_every_power_of_two(devices):
    """32 to 256 devices split an axis of 16k into shards smaller than its pieces (16 is the
    largest power of two dividing 48): each block of whole pieces is still hashed, with no
    gather, by a process holding all of it, from its own shards, and the digests are the
    hand-computed ones: on one process, on 16 processes (each holding whole pieces) and on a
    2-D mesh whose second axis replicates."""
    rng = np.random.default_rng(devices)
    state = {
        "rows": rng.standard_normal((2 * devices, 3), np.float32),  # 2 rows per shard
        "wide": rng.standard_normal((5, devices * 3), np.float32),  # axis 1 of 48k
        "stacked": rng.standard_normal((2, devices, 4), np.float32),  # 1 row per shard
        "odd": rng.standard_normal((7, 5), np.float32),  # replicated
    }
    expected = {name: pieces_digest_by_hand(value) for name, value in state.items()}
    axes = {"rows": 0, "wide": 1, "stacked": 1, "odd": None}
    for per_process in (devices, devices // 16):
        got = _hashed_in_place(state, [devices], {n: [a] for n, a in axes.items()}, per_process)
        assert got == expected, per_process
    two_d = {n: [a, None] for n, a in axes.items()}
    assert _hashed_in_place(state, [devices // 2, 2], two_d, devices // 16) == expected


@pytest.mark.parametrize("devices", [2, 3, 4, 6, 8, 12, 16, 24, 48])
def test_a_divisor_of_48_hashes_its_own_shards(devices):
    """A device count dividing 48 splits an axis into shards of whole pieces: each process
    of one device hashes exactly its own shard (the blocks are the shards)."""
    value = np.random.default_rng(devices).standard_normal((96, 2), np.float32)
    laid = _Laid(value, [devices], [0], 1, here=0)
    blocks = regions.merged(regions.distinct(laid), (96, 2), (2, 1))
    assert blocks == {
        ((k * 96 // devices, (k + 1) * 96 // devices), (0, 2)): {k} for k in range(devices)
    }
    assert _hashed_in_place({"v": value}, [devices], {"v": [0]}, 1) == {
        "v": pieces_digest_by_hand(value)
    }


def test_pieces_across_processes_are_the_one_case_that_gathers():
    """32 processes of one device on an axis of 64: a piece (4 rows) spans two processes, so
    no process can hash it from its own shards; a layout that ``regions.regrouped`` cannot
    lay out again (here not a mesh's: a mesh's is, tests/test_state_hash_topology.py) makes
    :func:`pieces.dealt` gather that array."""
    value = np.arange(64 * 3, dtype=np.float32).reshape(64, 3)
    laid = _Laid(value, [32], [0], 1, here=0)
    gathered = []

    def whole(leaf):
        gathered.append(leaf.shape)
        return value

    offsets, owners, jobs = pieces.dealt([("w", laid)], whole, 0)
    assert gathered == [(64, 3)] and offsets == [(0, 48)]
    table = np.zeros((48, 32), np.uint8)
    for start, counts, flat, block in jobs:
        table[start + flat] = np.frombuffer(pieces.block_digests(block, counts), np.uint8).reshape(
            -1, 32
        )
    assert hashlib.sha256(table.tobytes()).hexdigest() == pieces_digest_by_hand(value)
    assert set(owners[0]) == {0}  # the gathered array is one block: dealt to the first
