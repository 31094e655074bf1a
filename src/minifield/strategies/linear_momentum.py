"""``linear-momentum`` 1.0.0: the small teacher workload for fast operational checks.

64 examples of y = 2x + 1 on evenly spaced x in [-1, 1]; a linear model fit by
SGD with momentum on minibatches sampled without replacement. The minibatch of
update ``n`` is a pure function of (seed, n), so a resumed run needs no replay.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from .. import export
from .base import Program, Strategy

N_EXAMPLES = 64


def teacher_examples() -> dict[str, np.ndarray]:
    x = np.linspace(-1.0, 1.0, N_EXAMPLES, dtype=np.float32)
    return {"x": x, "y": (2.0 * x + 1.0).astype(np.float32)}


def heldout_mse(w: float, b: float, xs: list[float]) -> float:
    """Mean squared error against y = 2x + 1 on the held-out inputs (float64, on the host)."""
    x = np.asarray(xs, dtype=np.float64)
    return float(np.mean((w * x + b - (2.0 * x + 1.0)) ** 2))


class LinearProgram(Program):
    def __init__(self, recipe: dict, examples: dict[str, np.ndarray]):
        self.recipe = recipe
        training = recipe["training"]
        self.batch_size = training["batch_size"]
        self.examples_per_step = self.batch_size
        self.tokens_per_step = 0
        self.x = jnp.asarray(examples["x"], dtype=jnp.float32)
        self.y = jnp.asarray(examples["y"], dtype=jnp.float32)
        self.learning_rate = float(training["learning_rate"])
        self.optimizer = optax.sgd(self.learning_rate, momentum=training["momentum"])
        self._compiled = None

    def init_state(self) -> dict:
        seed = self.recipe["training"]["seed"]
        key = jax.random.key(seed)
        scale = self.recipe["model"]["init_scale"]
        kw, kb = jax.random.split(jax.random.fold_in(key, 0xC0FFEE))
        params = {
            "w": scale * jax.random.normal(kw, (1,), jnp.float32),
            "b": scale * jax.random.normal(kb, (1,), jnp.float32),
        }
        return {
            "params": params,
            "opt_state": self.optimizer.init(params),
            "rng": jax.random.key_data(key),
            "step": jnp.zeros((), jnp.int32),
            "cursor": jnp.zeros((), jnp.int32),
        }

    def _update(self, state, x_all, y_all):
        key = jax.random.wrap_key_data(state["rng"])
        order = jax.random.permutation(jax.random.fold_in(key, state["step"]), x_all.shape[0])
        idx = order[: self.batch_size]
        x, y = x_all[idx], y_all[idx]

        def loss_fn(params):
            pred = params["w"] * x + params["b"]
            return jnp.mean((pred - y) ** 2)

        loss, grads = jax.value_and_grad(loss_fn)(state["params"])
        updates, opt_state = self.optimizer.update(grads, state["opt_state"], state["params"])
        new_state = {
            "params": optax.apply_updates(state["params"], updates),
            "opt_state": opt_state,
            "rng": state["rng"],
            "step": state["step"] + 1,
            "cursor": state["cursor"] + self.batch_size,
        }
        return new_state, {"loss": loss}

    def compile(self) -> None:
        abstract = jax.tree_util.tree_map(
            lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), jax.eval_shape(self.init_state)
        )
        self._compiled = (
            jax.jit(self._update, donate_argnums=(0,)).lower(abstract, self.x, self.y).compile()
        )

    def step(self, state: dict) -> tuple[dict, dict[str, float]]:
        if self._compiled is None:
            self.compile()
        new_state, metrics = self._compiled(state, self.x, self.y)
        jax.block_until_ready(new_state)
        # a constant learning rate, reported like packed-sft's scheduled one
        return new_state, {"loss": float(metrics["loss"]), "learning_rate": self.learning_rate}

    def evaluate(self, state: dict) -> dict[str, float]:
        w = float(np.asarray(state["params"]["w"])[0])
        b = float(np.asarray(state["params"]["b"])[0])
        return {
            "heldout_mse": heldout_mse(w, b, self.recipe["evaluation"]["heldout_x"]),
            "w": w,
            "b": b,
        }

    def export(self, state: dict, directory: Path) -> None:
        params = {k: np.asarray(v) for k, v in state["params"].items()}
        export.write(directory, params, {"strategy": "linear-momentum", "model": "y = w*x + b"})


class LinearMomentum(Strategy):
    name = "linear-momentum"
    version = "1.0.0"
    description = (
        "Linear model y = w*x + b fit to 64 examples of y = 2x + 1 by SGD with momentum "
        "on minibatches sampled without replacement (the fast operational teacher workload)."
    )
    schema_file = "strategy-linear-momentum.schema.json"
    default_max_steps = 8
    default_every_steps = 2
    selection_metric = ("heldout_mse", "min")

    def check(self, recipe: dict) -> list[dict]:
        errors = []
        names = [item["name"] for item in recipe.get("inputs", []) if isinstance(item, dict)]
        unknown = [n for n in names if n != "examples"]
        if unknown:
            errors.append(
                {
                    "path": "/inputs",
                    "message": f"linear-momentum accepts only an input named 'examples'; got {unknown}",
                }
            )
        return errors

    def data_spec(self, recipe: dict) -> dict:
        pinned = {i["name"]: i["sha256"] for i in recipe.get("inputs", [])}
        return {
            "strategy": self.name,
            "prepare_version": 1,
            "examples": pinned.get("examples", "builtin:y=2x+1,n=64,linspace(-1,1)"),
        }

    def prepare(self, recipe: dict, files: dict[str, Path]) -> tuple[dict[str, np.ndarray], dict]:
        if "examples" not in files:
            return teacher_examples(), {"source": "builtin", "count": N_EXAMPLES}
        path = files["examples"]
        xs, ys = [], []
        with open(path, encoding="utf-8") as handle:
            for number, line in enumerate(handle, start=1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                    xs.append(float(row["x"]))
                    ys.append(float(row["y"]))
                except (ValueError, KeyError, TypeError) as exc:
                    raise ValueError(
                        f"{path}:{number}: expected a JSON object with numeric 'x' and 'y' ({exc})"
                    ) from exc
        batch = recipe["training"]["batch_size"]
        if len(xs) < batch:
            raise ValueError(
                f"{path}: {len(xs)} examples, fewer than training.batch_size={batch} "
                "(minibatches are sampled without replacement)"
            )
        arrays = {"x": np.asarray(xs, np.float32), "y": np.asarray(ys, np.float32)}
        return arrays, {"source": "examples", "count": len(xs)}

    def build(self, recipe: dict, examples: dict[str, np.ndarray]) -> Program:
        return LinearProgram(recipe, examples)

    def acceptance(self, recipe: dict, metrics: dict[str, Any]) -> dict:
        threshold = recipe["evaluation"]["max_heldout_mse"]
        value = metrics.get("heldout_mse")
        passed = value is not None and np.isfinite(value) and value <= threshold
        check = {
            "name": "heldout_mse",
            "value": value,
            "threshold": threshold,
            "passed": bool(passed),
        }
        return {"passed": bool(passed), "checks": [check]}

    def evaluate_export(self, recipe: dict, export_dir: Path) -> dict[str, Any]:
        params, _ = export.read(export_dir)
        w = float(np.asarray(params["w"]).reshape(-1)[0])
        b = float(np.asarray(params["b"]).reshape(-1)[0])
        return {"heldout_mse": heldout_mse(w, b, recipe["evaluation"]["heldout_x"]), "w": w, "b": b}
