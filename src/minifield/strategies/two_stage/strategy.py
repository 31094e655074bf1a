"""``two-stage`` 11.0.0: continued pretraining on raw text, then SFT from its export.

This project's reading of "two-stage computations" (see docs/two-stage.md): each stage is its
own computation of this one strategy, chosen by ``training.stage``:

- ``pretrain`` (stage 1): causal-language-model training of a Llama-family model on raw
  documents (:mod:`.corpus`): inputs ``train``, ``dev``, ``test`` are corpora; loss on every
  token; DEV/TEST report loss, perplexity and bits per byte. Starts from a random
  initialisation (or, with ``model.init.stage1``, from an earlier stage-1 export).
- ``sft`` (stage 2): packed-sft's supervised fine-tuning (same examples, masks, step and
  exact-match evaluation), initialised from the stage-1 export that ``model.init.stage1``
  pins file by file (:mod:`.stage1_export`); without it, from a random initialisation (the
  baseline the demo compares against).

Everything else is packed-sft's machinery, reused rather than copied: the model, the jitted
update, the optimizer, packing, the row order of update ``n`` (a pure function of seed and
``n``), data parallelism, checkpointing through the worker. A stage's export is an HF
directory whose ``model.json`` records the stage and the computation digest, so stage 2 can
check which stage-1 computation it starts from.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from ...data import encoding, packing, unknown_text
from ...data import tokenizer as tokenizers
from ...data.packing import Rows
from ...digest import sha256_bytes
from ...inputs.pinned import InputError
from ...state import export
from ...training import evaluator
from ..base import Program, Strategy, computation_digest
from ..lm import export_format
from ..lm import model_section as settings
from ..lm.program import LMProgram
from ..registry import get as registered
from . import corpus, stage1_export

#: evaluation keys of one stage only (the other stage's are removed: not in its digest)
SFT_ONLY = ("max_generate_examples", "min_dev_exact_match")
PRETRAIN_ONLY = ("max_dev_bits_per_byte",)


class DataError(InputError):
    """Supervised data or a tokenizer stage 2 cannot use (exit 2, nothing trained)."""


def _sft_view(recipe: dict) -> dict:
    """The recipe as packed-sft sees it: the same sections, without the stage-1 inputs."""
    skip = set(stage1_export.input_names(recipe["model"]))
    return {**recipe, "inputs": [i for i in recipe.get("inputs", []) if i["name"] not in skip]}


class TwoStage(Strategy):
    name = "two-stage"
    version = "11.0.0"
    description = (
        "Two-stage computations, one stage per computation (training.stage): 'pretrain' trains "
        "a Llama-family model as a causal LM on raw documents (packed with segment ids, loss on "
        "every token; DEV/TEST loss, perplexity, bits per byte); 'sft' fine-tunes on supervised "
        "pairs as packed-sft does, initialised from a stage-1 HF export pinned file by file "
        "(model.init.stage1, its content in the digest) or from a random initialisation."
    )
    default_max_steps = 300
    default_every_steps = 50
    selection_metric = ("dev_loss", "min")

    def check(self, recipe: dict) -> list[dict]:
        model, evaluation = recipe["model"], recipe["evaluation"]
        stage = recipe["training"]["stage"]
        errors = settings.llama_only(
            model,
            "two-stage trains Llama-family models (stage 2 starts from stage 1's HF export): "
            "llama or absent",
        )
        if stage == "pretrain" and evaluation.get("min_dev_exact_match", 0) > 0:
            errors.append(
                {
                    "path": "/evaluation/min_dev_exact_match",
                    "message": "only for training.stage sft (stage 1 has no prompts to answer)",
                }
            )
        if stage == "sft" and evaluation.get("max_dev_bits_per_byte") is not None:
            errors.append(
                {
                    "path": "/evaluation/max_dev_bits_per_byte",
                    "message": "only for training.stage pretrain",
                }
            )
        errors += [
            {**e, "message": e["message"].replace("packed-sft", "two-stage")}
            for e in _packed_sft().check(_sft_view(recipe))
        ]
        # after packed-sft's check, which drops train_on spelled at its absent value
        if stage == "pretrain" and "train_on" in recipe["training"]:
            errors.append(
                {
                    "path": "/training/train_on",
                    "message": "only for training.stage sft (stage 1 trains every token of "
                    "its documents)",
                }
            )
        if stage == "pretrain":
            errors += unknown_text.not_read(recipe["training"], "training.stage pretrain")
        for key in SFT_ONLY if stage == "pretrain" else PRETRAIN_ONLY:
            evaluation.pop(key, None)
        if stage == "pretrain":
            recipe["training"].pop("overlong", None)  # documents are chunked, never cut
        return errors

    def data_spec(self, recipe: dict) -> dict:
        stage = recipe["training"]["stage"]
        if stage == "sft":
            spec = _packed_sft().data_spec(recipe)
            return {
                **spec,
                "strategy": self.name,
                "stage": stage,
                "init": recipe["model"].get("init"),
            }
        return {
            "strategy": self.name,
            "stage": stage,
            "prepare_version": self.prepare_version,
            "inputs": {i["name"]: i["sha256"] for i in recipe.get("inputs", [])},
            "tokenizer": recipe["model"]["tokenizer"],
            "seq_len": recipe["training"]["seq_len"],
            "init": recipe["model"].get("init"),
        }

    def prepare(self, recipe: dict, files: dict[str, Path]) -> tuple[dict[str, np.ndarray], dict]:
        settings = recipe["model"]["tokenizer"]
        try:
            tokenizer = tokenizers.from_settings(settings, files)
        except tokenizers.TokenizerError as exc:
            raise DataError(str(exc)) from None
        if recipe["training"]["stage"] == "pretrain":
            arrays, meta = _prepare_corpus(recipe, files, tokenizer)
        else:
            try:
                arrays, meta = _packed_sft().prepare(_sft_view(recipe), files)
            except (encoding.DataError, tokenizers.TokenizerError) as exc:
                raise DataError(str(exc)) from None
        if "stage1" in (recipe["model"].get("init") or {}):
            tokenizer_json = stage1_export.stage2_tokenizer_json(tokenizer, files, settings)
            params, meta["stage1"] = stage1_export.load(
                recipe, files, tokenizer, tokenizer_json, self.name
            )
            arrays.update(params)
        meta["stage"] = recipe["training"]["stage"]
        return arrays, meta

    def unknown_tokens(self, recipe: dict, files: dict[str, Path]) -> dict[str, dict]:
        if recipe["training"]["stage"] != "sft":
            return {}
        return _packed_sft().unknown_tokens(_sft_view(recipe), files)

    def build(self, recipe: dict, examples: dict[str, np.ndarray]) -> Program:
        return TwoStageProgram(recipe, examples)

    def acceptance(self, recipe: dict, metrics: dict[str, Any]) -> dict:
        if recipe["training"]["stage"] == "sft":
            return _packed_sft().acceptance(recipe, metrics)
        evaluation, checks = recipe["evaluation"], []
        for name, key in (
            ("dev_loss", "max_dev_loss"),
            ("dev_bits_per_byte", "max_dev_bits_per_byte"),
        ):
            threshold = evaluation.get(key)
            if threshold is None:
                continue
            value = metrics.get(name)
            passed = value is not None and bool(np.isfinite(value)) and value <= threshold
            checks.append({"name": name, "value": value, "threshold": threshold, "passed": passed})
        return {"passed": all(c["passed"] for c in checks), "checks": checks}

    def evaluate_export(self, recipe: dict, export_dir: Path) -> dict[str, Any]:
        """DEV metrics from the export alone (its weights, tokenizer and DEV copy, which must
        be the file this recipe pins as ``dev``)."""
        from ...hf import directory as hf_directory

        directory = Path(export_dir)
        # the weights' sha256 is checked while hf_directory.load reads them
        _, config = export.read(directory, later=hf_directory.is_weights_file)
        if config.get("strategy", {}).get("name") != self.name:
            raise export.ExportError(f"{directory / export.MODEL_FILE}: not a two-stage export")
        dev_path = directory / config["dev"]["file"]
        data = dev_path.read_bytes() if dev_path.is_file() else b""
        pinned = {i["name"]: i["sha256"] for i in recipe.get("inputs", [])}.get("dev")
        if sha256_bytes(data) != pinned:
            raise export.ExportError(
                f"{dev_path}: sha256 {sha256_bytes(data)}, but the recipe pins {pinned} for dev"
            )
        check_lineage(recipe, config, directory / export.MODEL_FILE)
        tokenizer = tokenizers.from_config(config["tokenizer"], directory)
        cfg, params = hf_directory.load(directory, config)
        dev = evaluator.Evaluator(
            cfg, recipe["evaluation"]["batch_size"], tokenizer.eos_id, tokenizer.pad_id
        )
        if config["stage"] == "pretrain":
            arrays = _corpus_split("dev", dev_path, tokenizer, recipe["training"]["seq_len"])[0]
            return lm_metrics(dev, params, arrays, "dev")
        source, train_on = encoding.recipe_reading(recipe, "dev")
        encoded = encoding.encode_file(dev_path, tokenizer, source, train_on)
        arrays, _ = evaluator.split_arrays("dev", encoded, recipe, tokenizer.pad_id)
        return dev.split_metrics(params, arrays, "dev")


def check_lineage(recipe: dict, config: dict, where: Path) -> None:
    """The export's recorded start must be the recipe's: for stage 2, the stage-1
    computation digest and the sha256 of the stage-1 export record it pinned. The store's
    gate calls this through :meth:`TwoStage.evaluate_export` before it activates."""
    stage1 = (recipe["model"].get("init") or {}).get("stage1")
    expected = None
    if stage1:
        pins = {i["name"]: i["sha256"] for i in recipe.get("inputs", [])}
        expected = {
            "computation_digest": stage1["computation_digest"],
            "record_sha256": pins.get(stage1["record"]),
        }
    if config.get("stage") != recipe["training"]["stage"] or config.get("stage1") != expected:
        raise export.ExportError(
            f"{where}: lineage {config.get('stage')!r} from {config.get('stage1')} is not the "
            f"recipe's ({recipe['training']['stage']!r} from {expected})"
        )


def _corpus_split(split: str, path: Path, tokenizer, seq_len: int) -> tuple[dict, dict]:
    documents = corpus.read_documents(path)
    encoded, n_bytes = corpus.encode_split(documents, tokenizer, seq_len)
    packed = packing.pack(encoded, seq_len, "reject", tokenizer.pad_id)
    arrays = packed.rows.named(split)
    arrays[f"{split}_bytes"] = np.asarray(n_bytes, dtype=np.int64)
    return arrays, {**packed.stats, "documents": len(documents), "bytes": n_bytes}


def _prepare_corpus(recipe: dict, files: dict[str, Path], tokenizer) -> tuple[dict, dict]:
    seq_len = recipe["training"]["seq_len"]
    arrays: dict[str, np.ndarray] = {}
    meta: dict[str, Any] = {"splits": {}, "tokenizer": tokenizer.config()}
    for split in settings.SPLITS:
        split_arrays, meta["splits"][split] = _corpus_split(split, files[split], tokenizer, seq_len)
        arrays.update(split_arrays)
    arrays["dev_file"] = np.frombuffer(files["dev"].read_bytes(), dtype=np.uint8)
    if tokenizer.kind == "tokenizers-json":
        arrays["tokenizer_json"] = np.frombuffer(
            files[recipe["model"]["tokenizer"]["input"]].read_bytes(), dtype=np.uint8
        )
    meta["packing_efficiency"] = meta["splits"]["train"]["efficiency"]
    return arrays, meta


def lm_metrics(evaluator, params, arrays: dict[str, np.ndarray], split: str) -> dict[str, float]:
    """Loss per trained token, perplexity and bits per byte of one corpus split."""
    rows = Rows.of(arrays, split)
    loss = evaluator.loss(params, rows)
    # every slot the mask trains has its predecessor in its own chunk, so the mask's sum is
    # the number of targets the loss averaged over
    targets = float(np.sum(rows.loss_mask))
    n_bytes = int(arrays[f"{split}_bytes"])
    return {
        f"{split}_loss": loss["loss"],
        f"{split}_perplexity": loss["perplexity"],
        f"{split}_bits_per_byte": corpus.bits_per_byte(loss["loss"] * targets, n_bytes),
        f"{split}_targets": int(targets),
        f"{split}_bytes": n_bytes,
    }


class TwoStageProgram(LMProgram):
    """packed-sft's program (model, step, batches, compile, placement) with a stage's start,
    evaluation and export."""

    def __init__(self, recipe: dict, arrays: dict[str, np.ndarray]):
        super().__init__(recipe, arrays)
        self.stage = recipe["training"]["stage"]
        if "stage1" in (recipe["model"].get("init") or {}):
            from ...hf import pinned_base

            self.base_params = pinned_base.params_from_arrays(arrays)

    def evaluate(self, state: dict) -> dict[str, float]:
        if self.stage == "sft":
            return super().evaluate(state)
        return lm_metrics(self.evaluator, self._eval_params(state), self.arrays, "dev")

    def evaluate_test(self, state: dict) -> dict[str, float]:
        if self.stage == "sft":
            return super().evaluate_test(state)
        return lm_metrics(self.evaluator, self._eval_params(state), self.arrays, "test")

    def export(self, state: dict, directory: Path, group=None) -> None:
        """An HF directory (:mod:`minifield.hf.directory`) whose ``model.json`` records the stage, the computation
        digest and, for stage 2, the stage-1 computation it started from (``group``: as
        :meth:`LMProgram.export`'s)."""
        import jax

        from ...hf import directory as hf_directory
        from ...models.layers import layer_stack
        from ...state.arrays import to_host

        directory.mkdir(parents=True, exist_ok=True)
        pins = {i["name"]: i for i in self.recipe["inputs"]}
        if self.stage == "pretrain":
            dev_bytes = np.asarray(self.arrays["dev_file"]).tobytes()
            suffix = Path(pins["dev"].get("path", pins["dev"]["name"])).suffix or ".txt"
            dev_file = "dev" + (".jsonl" if suffix.lower() == ".jsonl" else ".txt")
            if dev_bytes.startswith(corpus.PARQUET_MAGIC):  # read by its content, named so
                dev_file = "dev.parquet"
            layout = "documents: <bos> text <eos>, chunked with one token of overlap"
        else:
            dev_bytes = np.asarray(self.arrays["dev_jsonl"]).tobytes()
            dev_file, layout = export_format.DEV_FILE, "<bos> prompt <sep> response <eos>"
        tokenizer_json = None
        if "tokenizer_json" in self.arrays:
            tokenizer_json = np.asarray(self.arrays["tokenizer_json"]).tobytes()
        config = {
            "strategy": {"name": TwoStage.name, "version": TwoStage.version},
            "stage": self.stage,
            "computation_digest": computation_digest(self.recipe),
            "model": self.cfg.to_dict(),
            "tokenizer": self.tokenizer.config(
                hf_directory.TOKENIZER_FILE if tokenizer_json is not None else None
            ),
            "layout": layout,
            "dev": {"file": dev_file, "sha256": sha256_bytes(dev_bytes)},
        }
        stage1 = (self.recipe["model"].get("init") or {}).get("stage1")
        if stage1:
            config["stage1"] = {
                "computation_digest": stage1["computation_digest"],
                "record_sha256": pins[stage1["record"]]["sha256"],
            }
        # per layer: a scanned run holds its blocks stacked (packed_sft.layer_stack)
        params = layer_stack.per_layer(state["params"])
        if group is None:  # one process: a host copy; else each process writes its slices
            params = jax.tree_util.tree_map(to_host, params)
        hf_directory.write(
            directory,
            self.cfg,
            params,
            self.tokenizer,
            tokenizer_json,
            {dev_file: dev_bytes},
            config,
            settings.export_dtype(self.recipe),
            # no max_shard_size: one model.safetensors whatever the size, the one weights file
            # stage 2 pins (model.init.stage1.weights)
            group=group,
        )


def _packed_sft():
    """packed-sft, which runs stage 2 (and checks the recipe's shared parts), from the registry:
    the strategy object, never its modules."""
    return registered(settings.NAME, settings.VERSION)
