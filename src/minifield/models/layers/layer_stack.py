"""The residual stack: every block in order, as a Python loop or one ``lax.scan``, with
optional rematerialisation (``cfg.execution``, see :mod:`minifield.models.execution`).

- Loop (the default): each block is traced and compiled separately, so compile time grows
  with depth. The jaxpr is exactly the one the models built before this module existed.
- Scan (``model.scan_layers: true``): one block body runs under ``lax.scan`` over layers
  stacked along a leading axis, so the block is compiled once whatever the depth. Per-layer
  trees (``blocks/00/...``: a LoRA run's frozen base and adapters, evaluation) are stacked
  *inside* the jitted computation, at the price of a copy of the block parameters (and of
  their gradients, its transpose).
- Stacked state (``model.scan_layers: true``, full fine-tuning): the training state holds the
  parameters *and* the optimizer's moments stacked (:func:`stack_layers`: ``blocks`` becomes
  ``{STACKED: tree of [L, ...] leaves}``), so the gradient comes out stacked, AdamW runs
  once per stacked leaf, and the compiled update holds no per-layer code at all: its compile
  time does not depend on depth. Checkpoints and state hashes of such a run are of the
  stacked layout; evaluation and exports convert to the per-layer one (:func:`per_layer`).
  A model given a stacked tree runs it as it is (loop or scan alike).
- Remat (``training.remat``): ``full`` wraps each block in ``jax.checkpoint`` (only the block
  inputs are kept for the backward pass, everything else is recomputed);
  ``dots_saveable`` keeps the matrix-product outputs and recomputes the rest (norms,
  activations, softmax); ``save_attention`` keeps the attention's inputs (rotated q, k, v)
  and output (:data:`SAVED_NAMES`), so the backward pass recomputes the norms and the MLP
  but not the q, k, v projections (the XLA path's softmax is recomputed from the kept q and
  k; a fused kernel's own residual, its log-sum-exp, is not named, so its forward reruns);
  ``offload_attention`` keeps the same in the host's memory (``pinned_host``) between the
  passes.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from . import attention

#: what ``save_attention`` and ``offload_attention`` keep: the attention's inputs (the
#: rotated q, k, v) and its output, by their ``jax.checkpoint`` names
SAVED_NAMES = (attention.NAME_INPUTS, attention.NAME_OUTPUT)


def _policy(name: str):
    if name == "full":
        return None  # save nothing but the block's inputs
    if name == "dots_saveable":
        return jax.checkpoint_policies.dots_saveable
    if name == "save_attention":
        return jax.checkpoint_policies.save_only_these_names(*SAVED_NAMES)
    if name == "offload_attention":  # the same, held in the host's memory until needed
        return jax.checkpoint_policies.save_and_offload_only_these_names(
            names_which_can_be_saved=[],
            names_which_can_be_offloaded=list(SAVED_NAMES),
            offload_src="device",
            offload_dst="pinned_host",
        )
    raise ValueError(f"training.remat: unknown policy {name!r}")


#: the one key of a ``blocks`` dict whose layers are stacked along a leading axis
STACKED = "stacked"


def layer_names(blocks: dict) -> list[str]:
    """The layers of ``blocks`` in order (``00``, ``01``, ...; ``[STACKED]`` when stacked)."""
    if STACKED in blocks:
        return [STACKED]
    return sorted(blocks, key=int)


def _is_layered(node) -> bool:
    return isinstance(node, dict) and isinstance(node.get("blocks"), dict)


def stack_layers(tree, stack=jnp.stack):
    """``tree`` with every ``{"blocks": {"00": t0, "01": t1, ...}, ...}`` dict in it (the
    parameters, and each moment estimate of an optimizer state) turned into
    ``{"blocks": {STACKED: t}, ...}``, the leaves of ``t`` the layers' leaves stacked in
    layer order along a new leading axis (``stack``: ``np.stack`` for host arrays)."""

    def stack_node(node):
        if not _is_layered(node) or STACKED in node["blocks"]:
            return node
        layers = [node["blocks"][name] for name in layer_names(node["blocks"])]
        stacked = jax.tree_util.tree_map(lambda *leaves: stack(leaves), *layers)
        return {**node, "blocks": {STACKED: stacked}}

    return jax.tree_util.tree_map(stack_node, tree, is_leaf=_is_layered)


def holds_stacked(cfg) -> bool:
    """Whether a full fine-tuning state of ``cfg`` holds its layers stacked."""
    return cfg.execution.scan_layers


def per_layer(tree):
    """The inverse of :func:`stack_layers`: ``tree`` with stacked ``blocks`` split into
    ``00``, ``01``, ... (unchanged when it holds none); compiled once per tree structure."""
    nodes = jax.tree_util.tree_leaves(tree, is_leaf=_is_layered)
    stacked = any(_is_layered(node) and STACKED in node["blocks"] for node in nodes)
    return _per_layer_compiled(tree) if stacked else tree


def _per_layer(tree):
    def unstack(node):
        if not _is_layered(node) or STACKED not in node["blocks"]:
            return node
        stacked = node["blocks"][STACKED]
        depth = jax.tree_util.tree_leaves(stacked)[0].shape[0]
        blocks = {
            f"{i:02d}": jax.tree_util.tree_map(lambda leaf, i=i: leaf[i], stacked)
            for i in range(depth)
        }
        return {**node, "blocks": blocks}

    return jax.tree_util.tree_map(unstack, tree, is_leaf=_is_layered)


_per_layer_compiled = jax.jit(_per_layer)


def is_stacked_leaf(path) -> bool:
    """Whether the leaf at ``path`` (a key path of :func:`jax.tree_util.tree_map_with_path`)
    holds layers stacked along its first axis."""
    return any(getattr(key, "key", None) == STACKED for key in path)


def run_blocks(execution, blocks: dict, names: list[str], block_fn: Callable, h, collect=False):
    """``h`` after ``block_fn(blocks[name], h)`` for every name in order; ``names`` ==
    ``[STACKED]``: the layers of ``blocks[STACKED]`` in order (see :func:`stack_layers`).

    ``collect``: ``block_fn`` returns ``(h, y)`` with ``y`` an array of a layer (or None:
    that layer has none), and the result is ``(h, ys)``: ``ys`` a list of arrays with a
    leading layer axis whose concatenation holds the layers' ``y`` in order (the router
    logits of the sparse layers, :mod:`minifield.models.router_loss`)."""
    fn = block_fn if collect else (lambda block, h: (block_fn(block, h), None))
    if execution.remat != "none":
        # Under scan the body is traced once, so common-subexpression elimination across
        # iterations cannot undo the recomputation; outside it, keep JAX's guard.
        fn = jax.checkpoint(
            fn, policy=_policy(execution.remat), prevent_cse=not execution.scan_layers
        )
    ys = []

    def layer(block, h):
        h, y = fn(block, h)
        if y is not None:
            ys.append(y[None])
        return h

    if names == [STACKED]:
        stacked = blocks[STACKED]
        if not execution.scan_layers:
            depth = jax.tree_util.tree_leaves(stacked)[0].shape[0]
            for i in range(depth):
                h = layer(jax.tree_util.tree_map(lambda leaf, i=i: leaf[i], stacked), h)
            return (h, ys) if collect else h
    elif not execution.scan_layers:
        for name in names:
            h = layer(blocks[name], h)
        return (h, ys) if collect else h
    else:
        stacked = jax.tree_util.tree_map(
            lambda *leaves: jnp.stack(leaves), *[blocks[n] for n in names]
        )
    h, y_L = jax.lax.scan(lambda carry, block: fn(block, carry), h, stacked)
    return (h, [] if y_L is None else [y_L]) if collect else h
