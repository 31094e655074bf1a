"""Run by ``test_sharded_init.py`` in a process that sees 4 forced host devices: builds the
packed-sft program of a recipe (argv[1]) over its examples, creates its state on the mesh and
prints what a test needs to judge the placement, as one JSON line.

Every reference figure here comes from the plain one-device code path of the same process
(a program that was never compiled for the mesh creates and evaluates on device 0 only).
"""

from __future__ import annotations

import dataclasses
import json
import re
import sys
from pathlib import Path

import jax
import numpy as np

from minifield import recipe as recipes
from minifield.data.packing import Rows
from minifield.state import checkpoint
from minifield.state.arrays import named_arrays, restore_like, state_hash
from minifield.training.train_step import init_train_state


def leaf_report(state) -> list[dict]:
    """Per leaf: whole size and the sizes of the slices each device holds."""
    out = []
    for name, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
        out.append(
            {
                "name": jax.tree_util.keystr(name),
                "size": int(np.size(leaf)),
                "replicated": bool(leaf.sharding.is_fully_replicated),
                "devices": sorted(d.id for d in leaf.sharding.device_set),
                "shard_sizes": [int(s.data.size) for s in leaf.addressable_shards],
            }
        )
    return out


def largest_array_in(hlo: str) -> int:
    """Elements of the largest array shape an optimised HLO module mentions."""
    sizes = [1]
    for dims in re.findall(r"[a-z]+[0-9]+\[([0-9,]+)\]", hlo):
        sizes.append(int(np.prod([int(d) for d in dims.split(",")])))
    return max(sizes)


def main(recipe_path: str) -> None:
    recipe = recipes.load(recipe_path)
    root = Path(recipe_path).parent / "in"
    files = {i["name"]: root / i["path"] for i in recipe.data["inputs"]}
    arrays = recipe.strategy.prepare(recipe.data, files)[0]

    one = recipe.strategy.build(recipe.data, arrays)  # never compiled: one device
    one_state = one.init_state()
    mesh = recipe.strategy.build(recipe.data, arrays)
    mesh.lay_out_mesh()  # what compile() does before compiling the update (not needed here)
    fresh = mesh.init_state()
    report = {
        "one_device_hash": state_hash(one_state),
        "one_device_devices": sorted(
            {d.id for leaf in jax.tree_util.tree_leaves(one_state) for d in leaf.devices()}
        ),
        "mesh_hash": state_hash(fresh),
        "fresh": leaf_report(fresh),
        "placed_is_fresh": all(
            a is b
            for a, b in zip(
                jax.tree_util.tree_leaves(mesh.place(fresh)),
                jax.tree_util.tree_leaves(fresh),
                strict=True,
            )
        ),
    }

    # the executable that created it: what one device holds and computes
    compiled = mesh.start.compiled_on_mesh
    memory = compiled.memory_analysis()
    report["compiled"] = {
        "output_bytes": int(memory.output_size_in_bytes),
        "temp_bytes": int(memory.temp_size_in_bytes),
        "largest_array": largest_array_in(compiled.as_text()),
    }
    report["state_bytes"] = int(sum(np.asarray(a).nbytes for a in named_arrays(one_state).values()))

    # a restored checkpoint: host arrays, placed slice by slice
    host = named_arrays(fresh)
    restored = restore_like(mesh.init_state(), host)
    report["restored_on_host"] = all(
        isinstance(leaf, np.ndarray) for leaf in jax.tree_util.tree_leaves(restored)
    )
    placed = mesh.place(restored)
    report["restored"] = leaf_report(placed)
    report["restored_hash"] = state_hash(placed)

    # what a resume restores into (the worker, the evaluate stage, the proof): the template
    # holds no array, only the shapes, dtypes and shardings of the state it creates
    template = mesh.state_template()
    report["template_abstract"] = all(
        isinstance(leaf, jax.ShapeDtypeStruct) and not isinstance(leaf, jax.Array)
        for leaf in jax.tree_util.tree_leaves(template)
    )
    report["template_matches_fresh"] = all(
        (t.shape, t.dtype, t.sharding) == (f.shape, f.dtype, f.sharding)
        for t, f in zip(
            jax.tree_util.tree_leaves(template), jax.tree_util.tree_leaves(fresh), strict=True
        )
    )
    saved = checkpoint.save(
        Path(recipe_path).parent / "ckpt", fresh, step=0, computation_digest="c" * 64
    )
    loaded, manifest = checkpoint.load(Path(saved.path), template, computation_digest="c" * 64)
    placed = mesh.place(loaded)
    checkpoint.verify_placed(placed, saved.path, manifest["state_hash"])
    report["template_restored"] = leaf_report(placed)
    report["template_restored_hash"] = state_hash(placed)

    # a base model's weights (host FP32 arrays): placed, then the state built around them
    base = jax.tree_util.tree_map(lambda a: np.asarray(a) * np.float32(1.5), host_params(host))
    random_init, mesh.start.compiled_on_mesh = mesh.start.compiled_on_mesh, None
    mesh.base_params = one.base_params = base
    from_base = mesh.init_state()
    report["base"] = leaf_report(from_base)
    report["base_hash"] = state_hash(from_base)
    report["base_one_device_hash"] = state_hash(one.init_state())
    mesh.base_params = one.base_params = None
    mesh.start.compiled_on_mesh = random_init

    # evaluation on the mesh against evaluation on one device
    state = fresh
    params_one = one_state["params"]
    dev = Rows.of(arrays, "dev")
    eval_params = mesh._eval_params(state)  # what evaluate() and evaluate_test() use
    report["eval_mesh"] = mesh.evaluator.loss(eval_params, dev)
    report["eval_one"] = one.evaluator.loss(params_one, dev)
    prompts = [
        np.asarray(arrays["dev_prompts"][i, : arrays["dev_prompt_len"][i]]).tolist()
        for i in range(int(arrays["dev_prompts"].shape[0]))
    ]
    model = mesh.evaluator.model
    report["eval_params"] = leaf_report(eval_params)
    report["generated_mesh"] = model.greedy_generate_batch(eval_params, mesh.cfg, prompts, 8, None)
    report["generated_one"] = model.greedy_generate_batch(params_one, one.cfg, prompts, 8, None)
    # a scanned model of 4 layers holds its blocks stacked [4, ...]: the shardings chosen for
    # it (shapes only: nothing is created)
    scanned = dataclasses.replace(
        mesh.cfg, n_layers=4, execution=dataclasses.replace(mesh.cfg.execution, scan_layers=True)
    )
    abstract = jax.eval_shape(lambda: init_train_state(scanned, mesh.optimizer, 0))
    shardings = mesh.data_parallel.state_shardings(mesh.layout.mesh, abstract)
    report["scanned"] = [
        {"name": jax.tree_util.keystr(path), "shape": list(leaf.shape), "spec": list(spec.spec)}
        for (path, leaf), spec in zip(
            jax.tree_util.tree_flatten_with_path(abstract["params"])[0],
            jax.tree_util.tree_leaves(shardings["params"]),
            strict=True,
        )
    ]
    print(json.dumps(report))


def host_params(host: dict) -> dict:
    """The ``params/...`` arrays of a flat state as the nested tree a base model gives."""
    tree: dict = {}
    for name, value in host.items():
        parts = name.split("/")
        if parts[0] != "params":
            continue
        node = tree
        for part in parts[1:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = value
    return tree


if __name__ == "__main__":
    main(sys.argv[1])
