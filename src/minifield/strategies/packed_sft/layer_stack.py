"""The residual stack: every block in order, as a Python loop or one ``lax.scan``, with
optional rematerialisation (``cfg.execution``, see :mod:`.execution`).

- Loop (the default): each block is traced and compiled separately, so compile time grows
  with depth. The jaxpr is exactly the one the models built before this module existed.
- Scan (``model.scan_layers: true``): the per-layer parameter trees are stacked along a new
  leading axis *inside* the jitted step and one block body runs under ``lax.scan``, so the
  block is compiled once whatever the depth. The state keeps its per-layer layout
  (``blocks/00/...``): checkpoints, state hashes, exports and base-model loading do not
  change; the price is a copy of the block parameters per step (the stack) and of their
  gradients (its transpose), small next to the activations of a training step.
- Remat (``training.remat``): ``full`` wraps each block in ``jax.checkpoint`` (only the block
  inputs are kept for the backward pass, everything else is recomputed);
  ``dots_saveable`` keeps the matrix-product outputs and recomputes the rest (norms,
  activations, softmax).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp


def _policy(name: str):
    if name == "full":
        return None  # save nothing but the block's inputs
    if name == "dots_saveable":
        return jax.checkpoint_policies.dots_saveable
    raise ValueError(f"training.remat: unknown policy {name!r}")


def run_blocks(execution, blocks: dict, names: list[str], block_fn: Callable, h):
    """``h`` after ``block_fn(blocks[name], h)`` for every name in order."""
    fn = block_fn
    if execution.remat != "none":
        # Under scan the body is traced once, so common-subexpression elimination across
        # iterations cannot undo the recomputation; outside it, keep JAX's guard.
        fn = jax.checkpoint(
            block_fn, policy=_policy(execution.remat), prevent_cse=not execution.scan_layers
        )
    if not execution.scan_layers:
        for name in names:
            h = fn(blocks[name], h)
        return h
    stacked = jax.tree_util.tree_map(lambda *leaves: jnp.stack(leaves), *[blocks[n] for n in names])
    h, _ = jax.lax.scan(lambda carry, block: (fn(block, carry), None), h, stacked)
    return h
