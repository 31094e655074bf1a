"""Expert slots: one expert's matrix of a mixture, named as the checkpoint stores it
(``blocks/NN/moe/experts/JJ/w_gate``, one HF tensor each: :data:`.families.NAME_TABLE`), and
where it is in the parameters, which hold each projection of a layer's experts stacked
(``blocks/NN/moe/experts/w_gate`` ``[E, in, out]``, :mod:`.moe`): the ``JJ``-th of that
stack. Loading puts each expert's tensor into its stack (:func:`put`), exporting reads it back
(:func:`at`). No JAX here (the prepare stage and the HF reader use it).
"""

from __future__ import annotations

import re

#: an expert slot: ``(blocks/NN/moe/experts)/(JJ)/(w_gate)``
_SLOT = re.compile(r"(.*/moe/experts)/(\d+)/([^/]+)")


def expert_slot(path: str) -> tuple[str, int] | None:
    """``(the stacked parameter, the expert)`` of an expert slot
    (``blocks/NN/moe/experts/JJ/w_gate`` -> ``(blocks/NN/moe/experts/w_gate, JJ)``); None for
    any other path."""
    found = _SLOT.fullmatch(path) if isinstance(path, str) else None
    return None if found is None else (f"{found[1]}/{found[3]}", int(found[2]))


def at(params: dict, path: str):
    """The leaf of ``params`` at an internal path; an expert slot's: ``leaf[j]`` of its
    stacked leaf (a NumPy view, or a device array's slice)."""
    slot = expert_slot(path)
    node = params
    for part in (path if slot is None else slot[0]).split("/"):
        node = node[part]
    return node if slot is None else node[slot[1]]


def put(params: dict, path: str, value, n_experts: int) -> None:
    """Set the leaf at ``path`` in ``params`` (dicts made on the way); an expert slot's
    value goes into its stacked leaf, a host array ``[n_experts, *value.shape]`` of
    ``value``'s dtype made on the first expert put there."""
    slot = expert_slot(path)
    *parents, leaf = (path if slot is None else slot[0]).split("/")
    node = params
    for key in parents:
        node = node.setdefault(key, {})
    if slot is None:
        node[leaf] = value
        return
    import numpy as np

    value = np.asarray(value)
    if leaf not in node:
        node[leaf] = np.empty((n_experts, *value.shape), value.dtype)
    if node[leaf].dtype != value.dtype:
        raise ValueError(f"{path}: dtype {value.dtype}, its other experts' {node[leaf].dtype}")
    node[leaf][slot[1]] = value
