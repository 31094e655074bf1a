"""Complete training state as named arrays, and its hash.

The complete state is everything that determines the future of a run:
parameters, optimizer state, RNG key data, the step and the data cursor. It is
kept as a pytree whose top-level keys are those parts; flattening gives stable
names (``params/w``, ``opt_state/0/trace/w``) so a checkpoint can be checked and
restored leaf by leaf, and a divergence can be named by the part that differs. The
complete-state hash (version 3) is computed where the arrays live, piece by piece
(:mod:`.pieces`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

from . import pieces


def _key_name(entry: Any) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(entry, attr):
            return str(getattr(entry, attr))
    return str(entry)


def to_host(leaf: Any) -> np.ndarray:
    """A host copy of one state array, wherever it lives.

    An array spread over several processes' devices is not fetchable as a whole:
    replicated, any local copy is the value; sharded, the pieces are gathered from
    every process (a collective: each process must make the same calls in the same
    order, which the training loop guarantees). The checkpoint commit and the export copy
    the state this way; the state hash does not (:func:`state_digests`), except for an
    array whose shards cut its hash pieces (:mod:`.pieces`).
    """
    if isinstance(leaf, jax.Array) and not leaf.is_fully_addressable:
        if leaf.is_fully_replicated:
            return np.asarray(leaf.addressable_data(0))
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(leaf, tiled=True))
    return np.asarray(jax.device_get(leaf))


def named_arrays(state: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """Flatten the state into ``{"part/sub/leaf": host numpy array}`` in a stable order.

    Already-flat host arrays (``named_arrays``' own output) come back unchanged, so a
    state copied to the host once can be hashed and checkpointed without a second copy.
    """
    leaves, _ = jax.tree_util.tree_flatten_with_path(state)
    out: dict[str, np.ndarray] = {}
    for path, leaf in leaves:
        name = "/".join(_key_name(entry) for entry in path)
        out[name] = leaf if isinstance(leaf, np.ndarray) else to_host(leaf)
    return out


def restore_like(template: Any, arrays: Mapping[str, np.ndarray]) -> Any:
    """Rebuild a state with ``template``'s structure from named arrays, checking every leaf.

    A leaf goes where the template's lives when that is one device; a template leaf spread
    over several devices (a state created in its sharding) leaves the value on the host, for
    ``Program.place`` to put each device's slice there: the whole array never lands on one
    device first (nor is read from a mesh spanning processes)."""
    leaves, treedef = jax.tree_util.tree_flatten_with_path(template)
    wanted = []
    for path, leaf in leaves:
        name = "/".join(_key_name(entry) for entry in path)
        if name not in arrays:
            raise ValueError(f"checkpoint lacks state array {name!r}")
        value = arrays[name]
        # shape and dtype only: the template may be spread over processes (not readable here)
        dtype = leaf.dtype if hasattr(leaf, "dtype") else np.asarray(leaf).dtype
        expected = np.dtype(dtype), tuple(np.shape(leaf))
        if (value.dtype, value.shape) != expected:
            raise ValueError(
                f"state array {name!r} is {value.dtype}{list(value.shape)}, "
                f"expected {expected[0]}{list(expected[1])}"
            )
        sharding = getattr(leaf, "sharding", None)  # an array's, or an abstract template's
        spread = sharding is not None and len(sharding.device_set) > 1
        wanted.append(value if spread else jax.numpy.asarray(value))
    extra = set(arrays) - {"/".join(_key_name(e) for e in p) for p, _ in leaves}
    if extra:
        raise ValueError(f"checkpoint has unexpected state arrays {sorted(extra)}")
    return jax.tree_util.tree_unflatten(treedef, wanted)


def byte_view(array: np.ndarray) -> np.ndarray:
    """The array's bytes in C order as a flat ``uint8`` view (a copy only when the array is
    not C-contiguous): what is hashed and written, without ``tobytes()``' copy."""
    return np.ascontiguousarray(array).reshape(-1).view(np.uint8)


#: The complete-state hash's definition: sha256 over one line per array, in name order.
#: Version 1 (checkpoints of format ``minifield-checkpoint/1``): each array's line
#: ``name|dtype|shape`` followed by its bytes. Version 2: lines ``name|dtype|shape|sha256``,
#: ``sha256`` that of the array's bytes (C order). Version 3 (this release): lines
#: ``name|dtype|shape|digest``, ``digest`` the sha256 of the array's canonical pieces'
#: sha256 digests (:mod:`.pieces`): each piece hashed where it lives, so the hash needs no
#: array gathered and is the same on any topology. The versions give different hashes of
#: the same state; hashes are compared only within one.
STATE_HASH_VERSION = 3
STATE_HASH_VERSIONS = (1, 2, 3)


def _header(name: str, array: Any) -> str:
    # dtype and shape only: the array may be spread over processes (not readable here)
    return f"{name}|{np.dtype(array.dtype).str}|{','.join(map(str, np.shape(array)))}"


def array_sha256(array: np.ndarray) -> str:
    """sha256 of one array's bytes in C order: its hash in a version-2 state hash (and a
    checkpoint manifest's per-array hash)."""
    return hashlib.sha256(byte_view(np.asarray(array))).hexdigest()


def array_digests(
    arrays: Mapping[str, np.ndarray], *, version: int = STATE_HASH_VERSION
) -> dict[str, str]:
    """``{name: per-array hash}`` of named host arrays in ``version`` (2: ``array_sha256``,
    3: ``pieces.array_digest``), large arrays hashed at once (``pieces.on_threads``)."""
    if version == 3:
        return pieces.host_digests(dict(arrays))
    names = sorted(arrays)
    digests = pieces.on_threads(
        names,
        lambda name: array_sha256(arrays[name]),
        lambda name: pieces.pooled(np.asarray(arrays[name]).nbytes, 1),
    )
    return dict(zip(names, digests, strict=True))


def named_leaves(state: Mapping[str, Any]) -> list[tuple[str, Any]]:
    """``(name, leaf)`` of every state array in name order, where each lives (no copy; an
    abstract template's ``ShapeDtypeStruct`` as it is)."""
    leaves, _ = jax.tree_util.tree_flatten_with_path(state)
    return sorted(
        (
            "/".join(_key_name(e) for e in path),
            leaf if isinstance(leaf, jax.Array | jax.ShapeDtypeStruct) else np.asarray(leaf),
        )
        for path, leaf in leaves
    )


def spans_processes(state: Mapping[str, Any]) -> bool:
    """Whether any array of ``state`` is spread over several processes' devices."""
    return any(
        isinstance(leaf, jax.Array) and not leaf.is_fully_addressable
        for leaf in jax.tree_util.tree_leaves(state)
    )


def state_digests(state: Mapping[str, Any]) -> dict[str, str]:
    """The version-3 per-array digests of ``state`` wherever its arrays live: each piece
    hashed by a process holding it, only digests exchanged (a collective when the state
    spans processes)."""
    return pieces.state_digests(named_leaves(state), to_host)


def hash_named_arrays(
    items, *, version: int = STATE_HASH_VERSION, digests: Mapping[str, str] | None = None
) -> str:
    """The complete-state hash (``version``) of ``(name, array)`` pairs, in the order given;
    versions 2 and 3 take each array's hash from ``digests`` where given (then the arrays
    are read for their dtype and shape only)."""
    if version not in STATE_HASH_VERSIONS:
        raise ValueError(f"state hash version {version!r}: expected one of {STATE_HASH_VERSIONS}")
    digest = hashlib.sha256()
    for name, array in items:
        if version == 1:
            array = np.asarray(array)
            digest.update(f"{_header(name, array)}\n".encode())
            digest.update(byte_view(array))
            continue
        if digests is not None:
            sha = digests[name]
        else:
            array = np.asarray(array)
            sha = array_sha256(array) if version == 2 else pieces.array_digest(array)
        digest.update(f"{_header(name, array)}|{sha}\n".encode())
    return digest.hexdigest()


def state_hash(state: Mapping[str, Any], *, version: int = STATE_HASH_VERSION) -> str:
    """The complete-state hash of every leaf (see :data:`STATE_HASH_VERSION`); version 3
    where the arrays live (no array gathered), versions 1 and 2 from a host copy."""
    if version == 3:
        return hash_named_arrays(named_leaves(state), digests=state_digests(state))
    return hash_named_arrays(sorted(named_arrays(state).items()), version=version)


def part_hashes(state: Mapping[str, Any]) -> dict[str, str]:
    """One hash per top-level state part, to say *which* part diverged."""
    return hashes(state)[1]


def hashes(state: Mapping[str, Any]) -> tuple[str, dict[str, str]]:
    """``(state_hash, part_hashes)`` from one pass over the pieces, where they live."""
    return hashes_of(dict(named_leaves(state)), state_digests(state))


def hashes_of(
    arrays: Mapping[str, Any], digests: Mapping[str, str] | None = None
) -> tuple[str, dict[str, str]]:
    """``(state_hash, part_hashes)`` of named host arrays from one pass over their bytes
    (each array hashed once, on several threads; ``digests``, when given, spare even that,
    and ``arrays`` are then read for their dtype and shape only): the whole and each part
    are hashes of the per-array hashes."""
    digests = array_digests(arrays) if digests is None else digests
    whole = hash_named_arrays(sorted(arrays.items()), digests=digests)
    return whole, part_hashes_of(arrays, digests)


def part_hashes_of(
    arrays: Mapping[str, Any], digests: Mapping[str, str] | None = None
) -> dict[str, str]:
    """``part_hashes`` of a state already flattened to named host arrays."""
    digests = array_digests(arrays) if digests is None else digests
    parts: dict[str, str] = {}
    for part in sorted({name.split("/", 1)[0] for name in arrays}):
        parts[part] = hash_named_arrays(
            sorted((n, a) for n, a in arrays.items() if n == part or n.startswith(part + "/")),
            digests=digests,
        )
    return parts
