"""Run by ``test_moe_lora.py`` in a process that sees 2 forced host devices: a Mixtral base
trained two updates, full fine-tuning and LoRA on the experts, each on 1 device and on 2 with
``shard_params``, from the same prepared examples; prints what the test judges as one JSON
line (the losses, the largest parameter difference, the placement, whether the fresh state
was the same bits on the mesh).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import jax
import numpy as np
from test_base_model import _prepare, base_recipe
from test_moe_lora import mixtral_lora_recipe, mixtral_root

from minifield import recipe as recipes


def run(recipe: dict, arrays: dict, devices: int) -> dict:
    recipe = json.loads(json.dumps(recipe))
    recipe["training"]["data_parallel"] = {"devices": devices, "shard_params": devices > 1}
    loaded = recipes.validate(recipe)
    program = loaded.strategy.build(loaded.data, arrays)  # the examples do not depend on it
    state = program.place(program.init_state())
    initial = jax.tree_util.tree_map(np.asarray, state["params"])
    losses = []
    for _ in range(2):
        state, metrics = program.step(state)
        losses.append(metrics["loss"])
    # the shapes each device holds of the experts' stacked matrix (LoRA: stacked adapter)
    expert = state["params"]["blocks"]["00"]["moe"]["experts"]
    leaf = expert["w_up"]["a"] if program.lora is not None else expert["w_up"]
    shards = [list(s.data.shape) for s in leaf.addressable_shards]
    params = jax.tree_util.tree_map(np.asarray, state["params"])
    return {
        "initial": initial,
        "params": params,
        "losses": losses,
        "program": program,
        "expert_shards": shards,
    }


def compare(recipe: dict, root: Path) -> dict:
    _, (arrays, _) = _prepare(recipe, root)
    one, two = run(recipe, arrays, 1), run(recipe, arrays, 2)
    same_start = jax.tree_util.tree_all(
        jax.tree_util.tree_map(np.array_equal, one["initial"], two["initial"])
    )
    differences = jax.tree_util.tree_map(
        lambda a, b: float(np.max(np.abs(a - b))), one["params"], two["params"]
    )
    return {
        "losses": [one["losses"], two["losses"]],
        "max_param_difference": max(jax.tree_util.tree_leaves(differences)),
        "same_start": bool(same_start),
        "placement": two["program"].placement,
        "expert_shards": two["expert_shards"],
    }


def main() -> None:
    root = mixtral_root(Path(sys.argv[1]))
    full = base_recipe(root, {"compute_dtype": "float32"})
    report = {"full": compare(full, root), "lora": compare(mixtral_lora_recipe(root), root)}
    print(json.dumps(report))


if __name__ == "__main__":
    main()
