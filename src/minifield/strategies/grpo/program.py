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
    one_process = "its rollouts, rewards and advantages are computed on that process's host"

    def __init__(self, recipe: dict, arrays: dict[str, np.ndarray]):
        from ...models.sampling import Sampling

        rl, training = recipe["rl"], recipe["training"]
        self.rl, self.G, self.N = rl, rl["num_generations"], training["batch_size"]
        self.seq_len, self.mu = training["seq_len"], rl["num_iterations"]
        self.reward_files = reward_files(recipe, arrays)
        super().__init__(recipe, arrays)
        self.examples_per_step = self.N // self.G  # prompts
        self.sampling = Sampling(rl["temperature"], rl["top_k"], rl["top_p"])
        self.stops = self.evaluator.stops
        self.train_ids = prompts.prompt_ids(arrays, "train")
        self.train_rows = prompts.rows_of(arrays, "train")
        self._reference = None  # rl.beta 0: none is loaded or computed
        if rl["beta"] > 0:
            self._reference = ReferencePolicy(self.cfg, rl["temperature"], self.lora)
        self.rollouts_dir: Path | None = None

    def attach(self, attempt_dir: Path) -> None:
        self.rollouts_dir = Path(attempt_dir) / rollouts_file.DIRECTORY

    # -- what the strategy fills in ------------------------------------------------------------
    def make_optimizer(self) -> tuple:
        """The schedule counts optimizer steps: μ per update."""
        from ...training import optimizer

        training = self.recipe["training"]
        steps = self.recipe["limits"]["max_steps"] * self.mu
        scaled = {**training, "warmup_steps": training["warmup_steps"] * self.mu}
        schedule = optimizer.make_schedule(scaled, steps)
        return optimizer.make_optimizer(scaled, steps, schedule), schedule

    def make_step(self, schedule):
        """μ optimizer steps on one batch of rollouts (:mod:`.update`)."""
        from . import update

        settings = objective.LossSettings(
            beta=self.rl["beta"],
            epsilon=self.rl["epsilon"],
            epsilon_high=self.rl["epsilon_high"],
            importance_sampling_level=self.rl["importance_sampling_level"],
        )
        return update.make_update(
            self.cfg,
            self.optimizer,
            schedule,
            settings,
            self.mu,
            self.rl["temperature"],
            self.lora,
            self.accum_steps,
        )

    def make_batches(self, arrays, training):
        """None: grpo makes each update's rows itself (rollouts), from no packed rows."""
        return None

    def abstract_batch(self) -> rollouts_file.Batch:
        """Every update's shapes: N rows of seq_len (the reference's with ``beta`` > 0)."""
        import jax

        rows = jax.ShapeDtypeStruct((self.N, self.seq_len), np.float32)
        return rollouts_file.Batch(
            jax.ShapeDtypeStruct((self.N, self.seq_len), np.int32),
            rows,
            rows,
            jax.ShapeDtypeStruct((self.N,), np.float32),
            rows if self.rl["beta"] > 0 else None,
        )

    def out_shardings(self) -> tuple:
        """The state, the metrics replicated, iteration 1's log-probabilities split as the
        rows."""
        return (*super().out_shardings(), self.layout.batch)

    def make_evaluator(self) -> RewardEvaluator:
        stops = stop_ids(self.tokenizer)
        return RewardEvaluator(self.recipe, self.cfg, self.tokenizer, stops, self.reward_files)

    # -- the update ------------------------------------------------------------------------
    def _rows(self):
        """The sharding of an update's rows on the mesh (None on one device)."""
        return None if self.layout is None else self.layout.batch

    def _on_device(self, batch: rollouts_file.Batch) -> rollouts_file.Batch:
        """The batch on the device (the reference's log-probabilities are there already: on
        the mesh, split as the rows)."""
        import jax

        if self.layout is None:
            return jax.tree_util.tree_map(jax.numpy.asarray, batch)
        return jax.device_put(batch, self.layout.batch)

    def _policy_params(self, state):
        from ...models.layers import layer_stack

        if self.lora is not None:
            return self._lora_params(state["params"])
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
                batch.tokens,
                base=getattr(self, "_base", None),
                start_params=self.base_params,
                layout=self.layout,
                data_parallel=self.data_parallel,
            )
            jax.block_until_ready(ref_logps)  # its own time; it stays on the device
            batch = batch._replace(ref_logps=ref_logps)
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
        host["loss_tokens"] = float(batch.mask.sum())
        return new_state, lambda: host

    # -- export ------------------------------------------------------------------------------
    def export_files(self) -> dict[str, bytes]:
        """The Python rewards' files, so the store's gate re-evaluates the export alone."""
        return {
            rollouts_file.export_name(name): path.read_bytes()
            for name, path in sorted(self.reward_files.items())
        }
