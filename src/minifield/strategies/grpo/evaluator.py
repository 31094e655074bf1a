"""Rewards of completions, and the DEV/TEST evaluation of a grpo policy by greedy decoding, in
training and from an export (the store's gate).

:meth:`RewardEvaluator.score` turns an update's completions into each reward's values, their
weighted total and the update's reward metrics. :meth:`RewardEvaluator.metrics` decodes every
prompt of a split greedily (the same stop ids and completion budget as the rollouts) and
reports, ``{split}_`` prefixed: ``reward`` (the mean total), ``pass_at_1`` (the share whose
total reaches ``evaluation.pass_reward``), ``exact_match`` (the mean of the first
``exact_match`` reward, when there is one), ``reward_{name}`` for each reward,
``completion_length`` (mean tokens) and ``truncated`` (the share without a stop token).
"""

from __future__ import annotations

import atexit
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ...digest import sha256_bytes
from ...rl import rewards, rollouts
from . import prompts, rollouts_file, section
from .section import python_reward_inputs

#: the prepared array holding a Python reward's pinned file, by input name
REWARD_FILE_ARRAY = "reward_file_{name}"


@dataclass(frozen=True)
class Scored:
    texts: list[str]
    values: dict[str, np.ndarray]  # reward name → [N] float64
    total: np.ndarray  # [N] float64
    lengths: np.ndarray  # [N] completion tokens
    truncated: np.ndarray  # [N] bool

    def metrics(self) -> dict[str, float]:
        """An update's reward metrics (its ``update`` event's)."""
        out = {"reward": float(self.total.mean()), "reward_std": float(self.total.std())}
        for name, values in self.values.items():
            out[f"reward_{name}"] = float(values.mean())
            out[f"reward_{name}_std"] = float(values.std())
        out["completion_length"] = float(self.lengths.mean())
        out["completion_length_max"] = float(self.lengths.max())
        out["truncated_fraction"] = float(self.truncated.mean())
        return out


def stop_ids(tokenizer) -> tuple[int, ...]:
    """The ids a completion ends with: the eos and every special added token — the end-of-turn
    ids supervised training ends an assistant turn with, and the unknown token where it is a
    special one: a completion that writes it stops there, so text the tokenizer cannot spell
    is never rewarded as if it were not there (decoding drops it)."""
    from ...data import assistant_turns

    return tuple(sorted(assistant_turns.special_ids(tokenizer.backend, tokenizer.eos_id)))


def reward_files(recipe: dict, arrays: dict) -> dict[str, Path]:
    """Each Python reward's pinned file, from the prepared arrays, as a file of its own (in a
    directory of this process's, named by the input, removed when the process ends)."""
    names = python_reward_inputs(recipe)
    if not names:
        return {}
    directory = Path(tempfile.mkdtemp(prefix="minifield-rewards-"))
    atexit.register(shutil.rmtree, directory, ignore_errors=True)
    out = {}
    for name in names:
        out[name] = directory / name
        out[name].write_bytes(np.asarray(arrays[REWARD_FILE_ARRAY.format(name=name)]).tobytes())
    return out


class RewardEvaluator:
    def __init__(self, recipe: dict, cfg, tokenizer, stops, files: dict[str, Path]):
        self.rewards = recipe["rl"]["rewards"]
        self.cfg, self.tokenizer, self.stops, self.files = cfg, tokenizer, stops, files
        self.max_new = recipe["rl"]["max_completion_length"]
        self.seq_len = recipe["training"]["seq_len"]
        self.batch_size = recipe["evaluation"]["batch_size"]
        self.pass_reward = recipe["evaluation"]["pass_reward"]
        self.exact = section.exact_match_reward(recipe)
        self.rows = None  # on_mesh: each greedy batch's rows split over the devices

    def on_mesh(self, rows_sharding, devices: int) -> None:
        """Decode on the data-parallel mesh (the parameters stay in the state's shardings):
        each batch's rows split over the devices when ``evaluation.batch_size`` divides over
        them, else every device decodes the whole batch."""
        if self.batch_size % devices == 0:
            self.rows = rows_sharding

    def score(self, made, rows: list[dict], update: int) -> Scored:
        texts = [self.tokenizer.decode(ids) for ids in made.completion_ids]
        picked = [rows[int(p)] for p in made.prompt_index]
        names = sorted({name for row in picked for name in row["columns"]})
        values = rewards.score(
            self.rewards,
            prompts=[row["prompt"] for row in picked],
            completions=texts,
            completion_ids=[list(ids) for ids in made.completion_ids],
            columns={name: [row["columns"].get(name) for row in picked] for name in names},
            update=update,
            files=self.files,
        )
        lengths = np.asarray([len(ids) for ids in made.completion_ids])
        total = rewards.total(self.rewards, values)
        return Scored(texts, values, total, lengths, np.asarray(made.truncated, bool))

    def greedy(self, params, prompt_ids: list[list[int]]) -> rollouts.Rollouts:
        """Greedy completions of every prompt, in batches of ``evaluation.batch_size`` (the
        last one padded with copies, so one compilation serves every batch)."""
        completions, truncated = [], []
        for start in range(0, len(prompt_ids), self.batch_size):
            chunk = prompt_ids[start : start + self.batch_size]
            padded = chunk + [chunk[0]] * (self.batch_size - len(chunk))
            ids, cut = rollouts.generate(
                params,
                self.cfg,
                padded,
                self.max_new,
                self.stops,
                length=self.seq_len,
                row_sharding=self.rows,
            )
            completions += ids[: len(chunk)]
            truncated += list(cut[: len(chunk)])
        n = len(prompt_ids)
        return rollouts.Rollouts(
            np.arange(n), np.zeros(n, np.int64), prompt_ids, completions, np.asarray(truncated)
        )

    def metrics(self, params, prompt_ids, rows, prefix: str, update: int = 0) -> dict[str, float]:
        scored = self.score(self.greedy(params, prompt_ids), rows, update)
        out = {
            f"{prefix}_reward": float(scored.total.mean()),
            f"{prefix}_pass_at_1": float(np.mean(scored.total >= self.pass_reward)),
        }
        if self.exact is not None:
            out[f"{prefix}_exact_match"] = float(scored.values[self.exact].mean())
        for name, values in scored.values.items():
            out[f"{prefix}_reward_{name}"] = float(values.mean())
        out[f"{prefix}_completion_length"] = float(scored.lengths.mean())
        out[f"{prefix}_truncated"] = float(scored.truncated.mean())
        return out

    def split_metrics(self, params, arrays: dict, split: str) -> dict[str, float]:
        return self.metrics(
            params, prompts.prompt_ids(arrays, split), prompts.rows_of(arrays, split), split
        )


def model_metrics(recipe: dict, model, prompts_path: Path, files: dict[str, Path], prefix="dev"):
    """The metrics of :meth:`RewardEvaluator.metrics` of a loaded model (an export, any HF
    directory with a chat template: :class:`minifield.hf.loaded_model.LoadedModel`) on the
    prompt file ``prompts_path``, rendered and scored as the recipe says."""
    from ...state.export import ExportError

    if model.template is None:
        raise ExportError(f"{model.where}: no chat template to render the prompts with")
    rows = prompts.read(prompts_path, rewards.columns_read(recipe["rl"]["rewards"]))
    room = recipe["training"]["seq_len"] - recipe["rl"]["max_completion_length"]
    ids = prompts.encode(rows, model.tokenizer, model.template, room)
    records = [{"prompt": r.prompt, "columns": r.columns} for r in rows]
    evaluator = RewardEvaluator(
        recipe, model.cfg, model.tokenizer, stop_ids(model.tokenizer), files
    )
    return evaluator.metrics(model.params, ids, records, prefix)


def export_metrics(recipe: dict, export_dir: Path) -> dict[str, float]:
    """DEV metrics from the export alone: its weights, tokenizer, chat template, its copy of
    the DEV prompts and of each Python reward's file, each the file the recipe pins."""
    from ...state.export import ExportError
    from ..lm import export_format

    model = export_format.ExportedModel(Path(export_dir))
    pins = {i["name"]: i["sha256"] for i in recipe.get("inputs", [])}
    dev = model.dev_file(pins.get("dev"))
    files = {}
    for name in python_reward_inputs(recipe):
        path = Path(export_dir) / rollouts_file.export_name(name)
        data = path.read_bytes() if path.is_file() else b""
        if sha256_bytes(data) != pins.get(name):
            raise ExportError(f"{path}: not the Python reward file the recipe pins as {name!r}")
        files[name] = path
    return model_metrics(recipe, model, dev, files)
