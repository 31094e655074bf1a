"""The grpo program: the language-model program (model, LoRA, state, checkpoints, export) with
online rollouts, rewards and the GRPO update in place of supervised batches.

One update (:meth:`GRPOProgram.dispatch`), all on the host's thread in this order, each part
timed for the ``update`` event (``rollout_seconds``, ``reward_seconds``,
``reference_seconds``, ``policy_seconds``):

1. the update's prompts: ``batch_size / G`` rows of the train split, an epoch permutation
   drawn from ``(seed, update)`` (:func:`minifield.data.batches.rows_for_step`);
2. G completions of each from the current policy (:mod:`minifield.rl.rollouts`; adapters
   merged for LoRA), every draw from ``(seed, update, prompt, completion)``;
3. the rewards (:mod:`minifield.rl.rewards`), their weighted total and the advantages;
4. with ``beta`` > 0, the reference policy's log-probabilities;
5. the compiled update (:mod:`.update`): μ optimizer steps;
6. the rollouts file of the update (:mod:`.rollouts_file`) when the attempt gave a directory.

Nothing here depends on what ran before in the process: a resumed attempt recomputes update
``n`` from the state after ``n - 1`` alone, so its rollouts and its state are the
uninterrupted run's.

With ``training.data_parallel.devices`` > 1 (the language-model program's mesh, laid out
by :meth:`compile`) steps 2, 4 and 5 run on the mesh with the update's rows split over
``data`` (each device decodes its own rows: a row's draws are its own); step 3 stays on
the host over the whole update, so a group's statistics are over all its completions.
``training.grad_accum_steps`` is the update's (:mod:`.update`).
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from ...data.batches import rows_for_step
from ...rl import advantages as group_advantages
from ...rl import objective, rollouts
from ..lm.program import LMProgram
from . import prompts, rollouts_file, section
from .evaluator import RewardEvaluator, reward_files, stop_ids
from .reference import ReferencePolicy


class GRPOProgram(LMProgram):
    export_strategy = {"name": section.NAME, "version": section.VERSION}

    def make_batches(self, arrays, training):
        """None: grpo makes each update's rows itself (rollouts), from no packed rows."""
        return None

    def __init__(self, recipe: dict, arrays: dict[str, np.ndarray]):
        from ...models.sampling import Sampling
        from ...training import optimizer
        from . import update

        super().__init__(recipe, arrays)
        rl, training = recipe["rl"], recipe["training"]
        self.rl, self.G, self.N = rl, rl["num_generations"], training["batch_size"]
        self.seq_len, self.mu = training["seq_len"], rl["num_iterations"]
        self.examples_per_step = self.N // self.G  # prompts
        self.tokens_per_step = self.N * self.seq_len
        self.sampling = Sampling(rl["temperature"], rl["top_k"], rl["top_p"])
        self.stops = stop_ids(self.tokenizer)
        self.train_ids = prompts.prompt_ids(arrays, "train")
        self.train_rows = prompts.rows_of(arrays, "train")
        # the schedule counts optimizer steps: μ per update
        steps = recipe["limits"]["max_steps"] * self.mu
        scaled = {**training, "warmup_steps": training["warmup_steps"] * self.mu}
        schedule = optimizer.make_schedule(scaled, steps)
        self.optimizer = optimizer.make_optimizer(scaled, steps, schedule)
        self.start.optimizer = self.optimizer
        self.loss_settings = objective.LossSettings(
            beta=rl["beta"],
            epsilon=rl["epsilon"],
            epsilon_high=rl["epsilon_high"],
            importance_sampling_level=rl["importance_sampling_level"],
        )
        self._update_fn = update.make_update(
            self.cfg,
            self.optimizer,
            schedule,
            self.loss_settings,
            self.mu,
            rl["temperature"],
            self.lora,
            self.accum_steps,
        )
        self._reference = None  # rl.beta 0: none is loaded or computed
        if rl["beta"] > 0:
            self._reference = ReferencePolicy(self.cfg, rl["temperature"], self.lora)
        self.reward_files = reward_files(recipe, arrays)
        self.evaluator = RewardEvaluator(
            recipe, self.cfg, self.tokenizer, self.stops, self.reward_files
        )
        self.rollouts_dir: Path | None = None

    def attach(self, attempt_dir: Path) -> None:
        self.rollouts_dir = Path(attempt_dir) / rollouts_file.DIRECTORY

    # -- the update ------------------------------------------------------------------------
    def compile(self) -> None:
        """The update is compiled for the shapes every update has (N rows of seq_len). With
        data parallelism, as packed-sft's: on the mesh, the batch's rows split over ``data``,
        the state replicated or sharded (``shard_params``), donated; the metrics replicated,
        iteration 1's log-probabilities split as the rows. LoRA runs on one device (refused
        on a mesh at validation, as packed-sft's)."""
        import jax

        if jax.process_count() > 1:
            raise RuntimeError(
                "grpo runs in one process (its rollouts, rewards and advantages are computed "
                "on that process's host); start one process with "
                "training.data_parallel.devices of its devices"
            )
        self.lay_out_mesh()
        abstract_state, _ = _abstract_state(self.start)
        batch = {
            "tokens": jax.ShapeDtypeStruct((self.N, self.seq_len), np.int32),
            "mask": jax.ShapeDtypeStruct((self.N, self.seq_len), np.float32),
            "weights": jax.ShapeDtypeStruct((self.N, self.seq_len), np.float32),
            "advantages": jax.ShapeDtypeStruct((self.N,), np.float32),
        }
        if self._reference is not None:
            batch["ref_logps"] = jax.ShapeDtypeStruct((self.N, self.seq_len), np.float32)
        shardings = {}
        if self.layout is not None:
            rows = self.layout.batch
            shardings = {
                "in_shardings": (self.layout.state, {name: rows for name in batch}),
                "out_shardings": (
                    self.layout.state,
                    self.data_parallel.replicated(self.layout.mesh),
                    rows,
                ),
            }
        fn = jax.jit(self._update_fn, donate_argnums=(0,), **shardings)
        if self.lora is None:
            compiled = fn.lower(abstract_state, batch).compile()
            self._compiled = compiled
        else:
            base = jax.eval_shape(lambda: self._base)
            compiled = fn.lower(abstract_state, batch, base).compile()
            self._compiled = lambda state, batch: compiled(state, batch, self._base)

    def _rows(self):
        """The sharding of an update's rows on the mesh (None on one device)."""
        return None if self.layout is None else self.layout.batch

    def _on_device(self, batch: dict[str, np.ndarray]) -> dict:
        import jax

        if self.layout is None:
            return {name: jax.numpy.asarray(value) for name, value in batch.items()}
        return jax.device_put(batch, self.layout.batch)

    def _policy_params(self, state):
        from ...models.layers import layer_stack

        if self.lora is not None:
            return self._merge(self._base, state["params"])
        return layer_stack.per_layer(state["params"])

    def dispatch(self, state: dict, step: int):
        import jax

        if self._compiled is None:
            self.compile()
        times = {}
        began = started = time.monotonic()
        update = step + 1  # updates are numbered from 1 (rollouts, rewards, files, events)
        index = rows_for_step(self.seed, step, self.N // self.G, len(self.train_ids))
        made = rollouts.sample_groups(
            self._policy_params(state),
            self.cfg,
            [self.train_ids[i] for i in index],
            index,
            self.G,
            max_new=self.rl["max_completion_length"],
            stops=self.stops,
            sampling=self.sampling,
            seed=self.seed,
            update=update,
            length=self.seq_len,
            row_sharding=self._rows(),
        )
        times["rollout_seconds"] = time.monotonic() - started
        started = time.monotonic()
        scored = self.evaluator.score(made, self.train_rows, update=update)
        advantages = group_advantages.advantages(scored.total, self.G, self.rl["scale_rewards"])
        batch = rollouts_file.batch_of(made, advantages, self.rl, self.seq_len, self.accum_steps)
        times["reward_seconds"] = time.monotonic() - started
        started = time.monotonic()
        ref_logps = None
        if self._reference is not None:
            ref_logps = self._reference.logps(
                state,
                batch["tokens"],
                base=getattr(self, "_base", None),
                start_params=self.base_params,
                layout=self.layout,
                data_parallel=self.data_parallel,
            )
            batch["ref_logps"] = ref_logps
        times["reference_seconds"] = time.monotonic() - started
        started = time.monotonic()
        new_state, metrics, logps = self._compiled(state, self._on_device(batch))
        jax.block_until_ready(new_state)
        times["policy_seconds"] = time.monotonic() - started
        host = {k: float(v) for k, v in metrics.items()}
        if self.rollouts_dir is not None:
            rollouts_file.write(
                self.rollouts_dir,
                update,
                made,
                scored,
                advantages,
                np.asarray(logps),
                None if ref_logps is None else np.asarray(ref_logps),
            )
        host.update(scored.metrics())
        host.update(times)
        # the whole update happened above: its time, for the update event (the loop reads
        # an update's metrics only after the next one is dispatched)
        host["update_seconds"] = time.monotonic() - began
        host["loss_tokens"] = float(batch["mask"].sum())
        return new_state, lambda: host

    # -- evaluation and export -------------------------------------------------------------
    def evaluate(self, state: dict) -> dict[str, float]:
        return self.evaluator.split_metrics(self._eval_params(state), self.arrays, "dev")

    def evaluate_test(self, state: dict) -> dict[str, float]:
        return self.evaluator.split_metrics(self._eval_params(state), self.arrays, "test")

    def export_files(self) -> dict[str, bytes]:
        """The Python rewards' files, so the store's gate re-evaluates the export alone."""
        return {
            rollouts_file.export_name(name): path.read_bytes()
            for name, path in sorted(self.reward_files.items())
        }


def _abstract_state(start):
    import jax

    abstract = jax.tree_util.tree_map(
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), jax.eval_shape(start.on_one_device)
    )
    return abstract, None
