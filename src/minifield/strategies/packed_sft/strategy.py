"""``packed-sft`` 12.0.0: supervised fine-tuning of a decoder-only transformer on packed rows.

Inputs (pinned JSONL, see :mod:`minifield.data.encoding`): ``train``, ``dev``,
``test`` (with ``training.mixture``, its sources instead of ``train``: :mod:`minifield.data.mixture`); plus the tokenizer file when ``model.tokenizer.kind`` is
``tokenizers-json``, or the files of a base model that ``model.base`` names
(:mod:`minifield.hf.pinned_base`: training starts from its weights, and its
tokenizer and chat template encode the examples; with ``model.lora`` only low-rank adapters
on it are trained, :mod:`minifield.training.lora`). The prepare stage packs each
split into rows (:mod:`minifield.data.packing`) and keeps the DEV/TEST
prompts with their expected answers for exact-match evaluation by greedy generation.

The strategy is the worker's and the store's view; the parts live beside it: the recipe
settings (:mod:`minifield.strategies.lm.model_section`), the program (:mod:`minifield.strategies.lm.program`), the evaluator (:mod:`minifield.training.evaluator`)
and the exported model (:mod:`minifield.strategies.lm.export_format`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from ...data import encode_pool, encoding, formats, mixture, packing, unknown_text
from ...data import tokenizer as tokenizers
from ...hf import pinned_base
from ...training import evaluator
from ..base import Program, pinned_inputs
from ..lm import export_format, model_section
from ..lm.checks import LMStrategy
from ..lm.model_section import SPLITS
from ..lm.program import LMProgram

# JAX (and what imports it: state, parallel, the model) is imported inside the methods that
# compute, so that validating a recipe, describing the strategy or hashing its
# data spec never imports JAX (the Snakefile validates every recipe when it is parsed).


class PackedSFT(LMStrategy):
    name, version = model_section.NAME, model_section.VERSION
    description = (
        "Supervised fine-tuning of a decoder-only transformer on packed sequences (segment ids, "
        "per-segment positions, block-diagonal causal attention, loss on response tokens only); "
        "AdamW with warmup and decay, global-norm clipping, BF16 compute by default; DEV loss and "
        "greedy exact-match evaluation; export for generation."
    )
    default_max_steps = 300
    default_every_steps = 50
    selection_metric = ("dev_loss", "min")
    lora_on_mesh = True
    estimates_step_memory = True
    # 2: a conversation trains every assistant turn (1 trained only the last), files of mixed
    # shapes are refused
    prepare_version = 2

    def own_checks(self, recipe: dict) -> list[dict]:
        """A mixture's spelling, and the inputs."""
        return mixture.normalize(recipe) + _input_errors(recipe)

    def checks_after(self, recipe: dict) -> list[dict]:
        """train_on and unknown text spelled once; exact-match needs examples to generate from;
        the rows split over the devices."""
        encoding.normalize_train_on(recipe["training"])
        unknown_text.normalize(recipe["training"])
        errors = []
        evaluation = recipe["evaluation"]
        if evaluation["min_dev_exact_match"] > 0 and evaluation["max_generate_examples"] == 0:
            errors.append(
                {
                    "path": "/evaluation/min_dev_exact_match",
                    "message": "needs evaluation.max_generate_examples > 0 (no prompt would be "
                    "generated from, so exact-match could never be measured)",
                }
            )
        batch_size, devices = recipe["training"]["batch_size"], self.devices_required(recipe)
        if batch_size % devices:
            errors.append(
                {
                    "path": "/training/data_parallel/devices",
                    "message": f"must divide training.batch_size={batch_size} "
                    f"(every device gets the same number of rows; got {devices})",
                }
            )
        return errors

    def data_spec(self, recipe: dict) -> dict:
        pinned = {i["name"]: i["sha256"] for i in recipe.get("inputs", [])}
        training, evaluation = recipe["training"], recipe["evaluation"]
        spec = {
            "strategy": self.name,
            "prepare_version": self.prepare_version,
            "inputs": pinned,
            "tokenizer": recipe["model"].get("tokenizer"),
            "seq_len": training["seq_len"],
            "overlong": training["overlong"],
            "max_generate_examples": evaluation["max_generate_examples"],
        }
        reading = {i["name"]: i for i in pinned_inputs(recipe) if len(i) > 2}
        if reading:  # only when given, so every other recipe keeps its examples digest
            spec["reading"] = reading
        if "train_on" in training:
            spec["train_on"] = training["train_on"]
        if unknown_text.KEY in training:  # only when true (check drops false)
            spec[unknown_text.KEY] = training[unknown_text.KEY]
        if "mixture" in training:
            # the sources in order, not their weights: recipes that only weigh the same
            # sources differently share the prepared examples
            spec["mixture"] = mixture.input_names(training)
        if "base" in recipe["model"]:
            # only with a base model, so every other recipe keeps its examples digest
            spec["tokenizer"] = None
            spec["base"] = recipe["model"]["base"]
            spec["chat_template"] = recipe["model"].get("chat_template")
        return spec

    def training_sources(self, recipe: dict) -> dict[str, dict]:
        """A mixture's sources, each packed on its own (:meth:`prepare_source`): its spec is
        what that source's rows depend on — the file and how it is read (not the name it has
        in one recipe), the tokenizer or base model and the packing settings — so recipes that
        mix one source with different others reuse its prepared rows. Without a mixture the
        one ``train`` input is prepared with the rest (its examples digest as before)."""
        training = recipe["training"]
        if "mixture" not in training:
            return {}
        pinned = {i["name"]: i for i in pinned_inputs(recipe)}
        spec = self.data_spec(recipe)
        kept = ("strategy", "prepare_version", "tokenizer", "seq_len", "overlong", "train_on")
        kept += (unknown_text.KEY,)  # refused or counted: part of what a source's rows are
        common = {key: spec[key] for key in (*kept, "base", "chat_template") if key in spec}
        common["part"] = "training source"
        model_inputs = model_section.base_model_inputs(recipe["model"])
        if (spec["tokenizer"] or {}).get("kind") == "tokenizers-json":
            model_inputs.append(spec["tokenizer"]["input"])
        common["model_inputs"] = {name: pinned[name]["sha256"] for name in model_inputs}
        return {
            name: {**common, "input": {k: v for k, v in pinned[name].items() if k != "name"}}
            for name in mixture.input_names(training)
        }

    def prepare_source(
        self, recipe: dict, name: str, files: dict[str, Path]
    ) -> tuple[dict[str, np.ndarray], dict]:
        """One training source's packed rows, with its format decision and packing figures."""
        _, _, tokenizer, encoded, _ = _reading(recipe, files)
        packed, record = _packed_source(recipe, name, encoded, tokenizer.pad_id, files)
        return packed.rows._asdict(), {"format": record, "stats": packed.stats}

    def prepare(
        self, recipe: dict, files: dict[str, Path], sources: dict[str, tuple] | None = None
    ) -> tuple[dict[str, np.ndarray], dict]:
        """Every split's arrays; ``sources``: training sources already prepared on their own
        (input name → ``(arrays, meta)`` of :meth:`prepare_source`), used as they are."""
        training = recipe["training"]
        arrays, described, tokenizer, encoded, load_base = _reading(recipe, files)
        meta: dict[str, Any] = {"splits": {}, "formats": {}, **described}
        packed = {}
        for source in mixture.input_names(training):
            if sources is not None and source in sources:
                rows, prepared = sources[source]
                held = packing.Rows._make(np.asarray(rows[key]) for key in packing.ROW_FIELDS)
                packed[source] = packing.Packed(held, prepared["stats"])
                meta["formats"][source] = prepared["format"]
            else:
                packed[source], meta["formats"][source] = _packed_source(
                    recipe, source, encoded, tokenizer.pad_id, files
                )
        if "mixture" in training:
            train, meta["mixture"] = packing.concatenate(packed)
            counts = [p.stats["rows"] for p in packed.values()]  # in mixture order
            arrays["train_source_rows"] = np.array(counts, dtype=np.int64)
        else:
            train = packed["train"]
        arrays.update(train.rows.named("train"))
        meta["splits"]["train"] = train.stats
        for split in SPLITS[1:]:
            examples, meta["formats"][split] = encoded(split)
            split_arrays, stats = evaluator.split_arrays(split, examples, recipe, tokenizer.pad_id)
            arrays.update(split_arrays)
            meta["splits"][split] = stats
        arrays["dev_jsonl"] = np.frombuffer(files["dev"].read_bytes(), dtype=np.uint8)
        if tokenizer.kind == "tokenizers-json" and "base" not in recipe["model"]:
            arrays["tokenizer_json"] = np.frombuffer(
                files[recipe["model"]["tokenizer"]["input"]].read_bytes(), dtype=np.uint8
            )
        meta["packing_efficiency"] = meta["splits"]["train"]["efficiency"]
        if "base_model" in meta:  # the weights, after every split is encoded (see _reading)
            meta["base_model"] = load_base()
        return arrays, meta

    def unknown_tokens(self, recipe: dict, files: dict[str, Path]) -> dict[str, dict]:
        _, _, tokenizer, encoded, _ = _reading(recipe, files)
        if tokenizer.backend is None:  # the byte tokenizer spells every text
            return {}
        counts = {}
        for name in [*mixture.input_names(recipe["training"]), *SPLITS[1:]]:
            record = encoded(name)[1]
            if "unknown_tokens" in record:
                counts[name] = record["unknown_tokens"]
        return counts

    def build(self, recipe: dict, examples: dict[str, np.ndarray]) -> Program:
        return LMProgram(recipe, examples)

    def acceptance(self, recipe: dict, metrics: dict[str, Any]) -> dict:
        evaluation = recipe["evaluation"]
        checks = []

        def add(name, threshold, ok):
            value = metrics.get(name)
            passed = value is not None and np.isfinite(value) and ok(value)
            checks.append(
                {"name": name, "value": value, "threshold": threshold, "passed": bool(passed)}
            )

        if evaluation["max_generate_examples"] > 0:
            add(
                "dev_exact_match",
                evaluation["min_dev_exact_match"],
                lambda v: v >= evaluation["min_dev_exact_match"],
            )
        if evaluation["max_dev_loss"] is not None:
            add("dev_loss", evaluation["max_dev_loss"], lambda v: v <= evaluation["max_dev_loss"])
        return {"passed": all(c["passed"] for c in checks), "checks": checks}

    def evaluate_export(self, recipe: dict, export_dir: Path) -> dict[str, Any]:
        """DEV metrics from the export alone: its weights, its tokenizer and its copy of the
        DEV split, which must be the file this recipe pins as ``dev``; a large export a layer
        at a time (:func:`export_format.streams`, :class:`evaluator.StreamedEvaluator`)."""
        streamed = export_format.streams(Path(export_dir))
        model = export_format.ExportedModel(Path(export_dir), streamed=streamed)
        pinned = {i["name"]: i["sha256"] for i in recipe.get("inputs", [])}.get("dev")
        encoded = model.encode_dev(pinned, *encoding.recipe_reading(recipe, "dev"))
        arrays, _ = evaluator.split_arrays("dev", encoded, recipe, model.tokenizer.pad_id)
        kind = evaluator.StreamedEvaluator if streamed else evaluator.Evaluator
        tokens = model.tokenizer
        dev = kind(model.cfg, recipe["evaluation"]["batch_size"], tokens.eos_id, tokens.pad_id)
        return dev.split_metrics(model.params, arrays, "dev")


def _input_errors(recipe: dict) -> list[dict]:
    """The pinned inputs a recipe must name (its splits or mixture sources, the base model's
    files, a tokenizer file, harness task files) and nothing else."""
    model = recipe["model"]
    names = [i["name"] for i in recipe.get("inputs", [])]
    errors = []
    sources = mixture.input_names(recipe["training"])
    held_out = [split for split in SPLITS if split != "train"]
    wanted = sources + held_out + model_section.base_model_inputs(model)
    errors += [
        {
            "path": f"/training/mixture/{index}/input",
            "message": f"{name!r} is a held-out split or part of the model, not training data",
        }
        for index, name in enumerate(sources)
        if name in wanted[len(sources) :]
    ]
    tokenizer = model.get("tokenizer", {"kind": "byte"})
    if tokenizer["kind"] == "tokenizers-json":
        wanted.append(tokenizer["input"])
    missing = [n for n in wanted if n not in names]
    if missing:
        errors.append(
            {
                "path": "/inputs",
                "message": f"packed-sft needs pinned inputs named {wanted}; missing {missing}",
            }
        )
    # a harness task's files are pinned inputs too (checked task by task in recipe.py)
    harness = recipe["evaluation"].get("harness") or {}
    tasks = [t[key] for t in harness.get("tasks", []) for key in ("config", "data")]
    unknown = [n for n in names if n not in wanted and n not in tasks]
    if unknown:
        errors.append(
            {
                "path": "/inputs",
                "message": f"packed-sft accepts only inputs {wanted} (and the files of "
                f"evaluation.harness.tasks); got unexpected {unknown}",
            }
        )
    return errors


def _reading(recipe: dict, files: dict[str, Path]):
    """What encoding the recipe's files needs: the arrays (the base model's, once
    ``load_base()`` has run), what the manifest says of the tokenizer (and base model), the
    tokenizer, ``encoded(name)`` → (the input's examples encoded, its format decision), and
    ``load_base()`` → the base model's description (its arrays added; once).

    The base model's tokenizer and template come from its files, so its weights load after the
    conversations are encoded: loading them starts JAX's backends, after which conversations
    are encoded in one process (:mod:`minifield.data.encode_pool`). Files the tokenizer cannot be read from
    load the weights first, which report the problem as they always have."""
    arrays: dict[str, np.ndarray] = {}
    meta: dict[str, Any] = {}
    described: list[dict] = []

    def load_base() -> dict:
        if not described:
            loaded, description = pinned_base.load(recipe, files)
            arrays.update(loaded)
            described.append(description)
        return described[0]

    if "base" in recipe["model"]:
        # what config.json alone refuses (a quantization, the device's memory), before the
        # conversations are encoded and the weights read
        pinned_base.check_config(recipe, files, step_memory=True)
        meta["base_model"] = None  # load_base() fills it (the manifest's key order as before)
        try:
            tokenizer, template = pinned_base.tokenizer_from_files(recipe, files)
        except Exception:  # noqa: BLE001 - the weights-first order below reports it as before
            meta["base_model"] = load_base()
            tokenizer, template = pinned_base.tokenizer_from_arrays(recipe, arrays, files)
        meta["chat_template"] = template.source
        processes = encode_pool.workers()  # operational: the same examples for any number
        tokenizer_input = recipe["model"]["base"]["tokenizer"]

        def read_and_encode(name, source, train_on):
            return pinned_base.read_and_encode_chat(
                files[name], source, tokenizer, template, train_on, processes
            )
    else:
        tokenizer = tokenizers.from_settings(recipe["model"]["tokenizer"], files)
        tokenizer_input = recipe["model"]["tokenizer"].get("input", "tokenizer")

        def read_and_encode(name, source, train_on):
            read = formats.read(files[name], source)
            return encoding.encode_examples(read.examples, tokenizer, train_on, files[name]), (
                read.record()
            )

    meta["tokenizer"] = tokenizer.config()
    allow = unknown_text.allowed(recipe["training"])

    def encoded(name):
        """The input's examples encoded and its format decision, with its unknown tokens
        counted where allowed (refused otherwise: :mod:`minifield.data.unknown_text`)."""
        source, train_on = encoding.recipe_reading(recipe, name)
        examples, record = read_and_encode(name, source, train_on)
        where = str(files.get(tokenizer_input, tokenizer_input))
        counted = unknown_text.check(examples, tokenizer, files[name], source, allow, where)
        return examples, record if counted is None else {**record, "unknown_tokens": counted}

    return arrays, meta, tokenizer, encoded, load_base


def _packed_source(recipe: dict, name: str, encoded, pad_id: int, files: dict[str, Path]):
    """A training input packed into rows, and its format decision."""
    training = recipe["training"]
    examples, record = encoded(name)
    packed = packing.pack(examples, training["seq_len"], training["overlong"], pad_id)
    if packed.stats["rows"] == 0:
        raise encoding.DataError(
            f"{files[name]}: no example fits training.seq_len={training['seq_len']}"
        )
    return packed, record
