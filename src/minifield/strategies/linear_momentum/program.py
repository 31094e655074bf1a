"""The compiled ``linear-momentum`` program: init, the jitted SGD-with-momentum update, evaluate,
export. Imported only when a recipe is built for training (it needs JAX and optax)."""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax

from ...state import export
from ..base import Program, compiled_memory
from .teacher import heldout_mse


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
        self.memory = compiled_memory(self._compiled)

    def step(self, state: dict) -> tuple[dict, dict[str, float]]:
        new_state, read_metrics = self.dispatch(state, -1)
        jax.block_until_ready(new_state)
        return new_state, read_metrics()

    def dispatch(self, state: dict, step: int):
        if self._compiled is None:
            self.compile()
        new_state, metrics = self._compiled(state, self.x, self.y)
        # a constant learning rate, reported like packed-sft's scheduled one
        return new_state, lambda: {
            "loss": float(metrics["loss"]),
            "learning_rate": self.learning_rate,
        }

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
