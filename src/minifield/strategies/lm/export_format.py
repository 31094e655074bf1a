"""The exported packed-sft model: what an export holds, how it is written, and how it is read
back to generate.

An export is self-contained, so the store re-evaluates it alone: its weights, ``model.json``
(the strategy, the model config, the tokenizer settings, the token layout, the packing and
the DEV file's sha256), the tokenizer files, and a copy of the DEV split. A Llama model's
export is a HuggingFace directory (:mod:`minifield.hf.directory`), with LoRA's PEFT adapter beside the
merged weights; the GPT model's is the project's own FP32 ``.npy`` format
(:mod:`minifield.export`). Importing this module does not import JAX.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ... import atomic
from ...data import encoding, formats
from ...data import tokenizer as tokenizers
from ...digest import sha256_bytes
from ...hf import loaded_model, pinned_base
from ...state import export
from ...training import peft_adapter
from . import model_section

#: files an export carries besides its weights (so the store can re-evaluate it alone)
DEV_FILE = "dev.jsonl"
TOKENIZER_FILE = "tokenizer.json"
#: strategies whose exports are this model family (two-stage's stage 1 continues raw text;
#: preference's DEV copy holds pairs, grpo's prompts)
FAMILY = (model_section.NAME, "two-stage", "preference", "grpo")


def config(
    recipe: dict, cfg, tokenizer, tokenizer_file, dev_bytes: bytes, strategy: dict | None = None
) -> dict:
    """``model.json`` of a packed-sft export (``strategy``: another strategy's identity, for
    one that exports this model family; None: packed-sft's)."""
    tokenizer_settings = tokenizer.config(tokenizer_file)
    layout = "<bos> prompt <sep> response <eos>"
    if "base" in recipe["model"]:
        # the base model's tokenizer files, beside the weights under their HF names
        from ...hf.directory import TOKENIZER_CONFIG_FILE

        tokenizer_settings = {
            "kind": pinned_base.EXPORT_TOKENIZER_KIND,
            "file": tokenizer_file,
            "config_file": TOKENIZER_CONFIG_FILE,
            "vocab_size": tokenizer.vocab_size,
        }
        layout = "chat_template (tokenizer_config.json)"
    return {
        "strategy": strategy or {"name": model_section.NAME, "version": model_section.VERSION},
        "model": cfg.to_dict(),
        "tokenizer": tokenizer_settings,
        "layout": layout,
        "packing": {
            "seq_len": recipe["training"]["seq_len"],
            "overlong": recipe["training"]["overlong"],
        },
        "dev": {"file": DEV_FILE, "sha256": sha256_bytes(dev_bytes)},
    }


def write(
    directory: Path,
    recipe: dict,
    arrays: dict,
    cfg,
    tokenizer,
    params,
    lora_run=None,
    strategy=None,
    extra_files: dict[str, bytes] | None = None,
    group=None,
    fetch=None,
):
    """Write the export of ``params`` (per layer, FP32) into ``directory`` (``strategy``: as
    :func:`config`; ``extra_files``: further files the export carries, name → bytes, listed
    and hashed in ``model.json`` with the others).

    ``lora_run``: ``(settings, adapters)`` of a LoRA run, whose ``params`` are the merged
    weights; its PEFT adapter goes into ``adapter/`` beside them (what transformers, the
    store's gate and ``minifield generate`` load without the base). ``fetch``: a leaf of
    ``params`` -> its FP32 host array, asked as each tensor is written (None: the leaf is
    the array; a LoRA run's :class:`minifield.training.host_merge.HostMerge` makes it).

    ``group``: the processes of a state spread over several, every one calling this (a
    collective): each writes the slices of the weights and adapters its devices hold
    (:mod:`minifield.hf.parallel_files`, no tensor gathered; the GPT model's ``.npy`` files
    too), process 0 everything else.
    """
    from ...state.arrays import named_arrays

    directory.mkdir(parents=True, exist_ok=True)
    dev_bytes = np.asarray(arrays["dev_jsonl"]).tobytes()
    tokenizer_json = None
    if "tokenizer_json" in arrays:
        tokenizer_json = np.asarray(arrays["tokenizer_json"]).tobytes()
    tokenizer_file = TOKENIZER_FILE if tokenizer_json is not None else None
    model_json = config(recipe, cfg, tokenizer, tokenizer_file, dev_bytes, strategy)
    if cfg.architecture != "llama":  # the GPT model keeps the .npy format
        files = {DEV_FILE: dev_bytes}
        if tokenizer_json is not None:
            files[TOKENIZER_FILE] = tokenizer_json
        if group is not None:
            _write_npy_together(directory, params, model_json, files, group)
            return
        for name, data in files.items():
            atomic.write_bytes(directory / name, data)
        export.write(directory, named_arrays(params), model_json)
        return
    from ...hf import directory as hf_directory
    from ...state.arrays import to_host

    tokenizer_config_json = base_config = None
    extra = {DEV_FILE: dev_bytes, **(extra_files or {})}
    if "base" in recipe["model"]:
        tokenizer_config_json = pinned_base.export_tokenizer_config(
            recipe, np.asarray(arrays[pinned_base.TOKENIZER_CONFIG_ARRAY]).tobytes()
        )
        base_config = pinned_base.base_config(arrays)  # carried over field by field
        if pinned_base.GENERATION_CONFIG_ARRAY in arrays:
            extra[hf_directory.GENERATION_CONFIG_FILE] = np.asarray(
                arrays[pinned_base.GENERATION_CONFIG_ARRAY]
            ).tobytes()
    if lora_run is not None:
        model_json["lora"] = _write_adapter(
            directory / peft_adapter.ADAPTER_DIR, recipe, cfg, *lora_run, group=group
        )
    hf_directory.write(
        directory,
        cfg,
        params,
        tokenizer,
        tokenizer_json,
        extra,
        model_json,
        model_section.export_dtype(recipe),
        tokenizer_config_json,
        base_config,
        model_section.export_max_shard_size(recipe),
        fetch=fetch or to_host,  # tensor by tensor as each shard is written, one process
        group=group,
    )


def _write_npy_together(directory: Path, params, model_json: dict, files: dict, group) -> None:
    """The GPT model's ``.npy`` export (:func:`minifield.state.export.write`'s files, byte for
    byte) written by the processes that hold its arrays, nothing gathered; process 0 writes
    ``files`` and ``model.json``."""
    from ...hf import parallel_files
    from ...state.arrays import named_leaves

    (directory / "weights").mkdir(parents=True, exist_ok=True)
    tensors, layouts, entries = {}, {}, []
    for number, (name, leaf) in enumerate(named_leaves(params)):  # export.write's order
        if np.dtype(leaf.dtype) != np.float32:
            raise ValueError(f"parameter {name}: {leaf.dtype}, the export writes FP32 arrays")
        file = export.weight_file(number)
        tensors[file] = {
            "": parallel_files.Tensor(tuple(leaf.shape), (parallel_files.Source(leaf),))
        }
        layouts[file] = parallel_files.npy_layout(leaf.shape, "float32")
        entries.append((name, file, np.dtype(np.float32).str, tuple(leaf.shape)))
    parallel_files.write_laid_out(directory, tensors, layouts, "float32", group)
    if group.rank != 0:
        return
    for name, data in files.items():
        atomic.write_bytes(directory / name, data)
    export.write_record(directory, entries, model_json)


def _write_adapter(directory: Path, recipe: dict, cfg, lora_settings, adapters, group=None) -> dict:
    """Write the PEFT adapter; returns what ``model.json`` records of it."""
    items = {i["name"]: i for i in recipe["inputs"]}
    config_item = items[recipe["model"]["base"]["config"]]
    # PEFT's base_model_name_or_path: where the pinned base model's config.json lives
    where = config_item.get("path") or config_item.get("url") or config_item["name"]
    base_name = where.rsplit("/", 1)[0] if "/" in where else "."
    peft_adapter.write_adapter(directory, lora_settings, adapters, base_name, cfg, group)
    names = model_section.base_model_inputs(recipe["model"])
    return {
        **lora_settings.to_dict(),
        "adapter_dir": peft_adapter.ADAPTER_DIR,
        "base_inputs": {name: items[name]["sha256"] for name in sorted(names)},
    }


def streams(directory: Path) -> bool:
    """Whether the store re-evaluates this export a layer at a time: an HF export whose FP32
    parameters exceed :data:`minifield.training.evaluator.STREAM_ABOVE_BYTES` (decided by
    the model alone, so every host judges an artifact alike)."""
    from ...hf.checkpoint import fp32_bytes
    from ...models.llama_config import LlamaConfig
    from ...training.evaluator import STREAM_ABOVE_BYTES

    try:
        config = atomic.read_json(Path(directory) / export.MODEL_FILE)["config"]
        if "weights" not in config:
            return False  # the GPT model's .npy export: small, read whole
        cfg = LlamaConfig.from_dict(config["model"])
    except (OSError, ValueError, KeyError, TypeError):
        return False  # ExportedModel names what is wrong with the export
    return fp32_bytes(cfg) > STREAM_ABOVE_BYTES


class ExportedModel(loaded_model.LoadedModel):
    """An exported packed-sft model: parameters, config and tokenizer, ready to generate
    (prompts in the layout its run trained, see :meth:`prompt_ids`)."""

    def __init__(self, directory: Path, streamed: bool = False):
        """``streamed`` (an HF export): ``params`` is a
        :class:`minifield.hf.directory.LayerFiles`, the weights read a layer at a time when
        asked (the files verified now), for :class:`minifield.training.evaluator.StreamedEvaluator`."""
        import jax

        from ...hf import directory as hf_directory
        from ...models import model
        from ...state.arrays import restore_like

        directory = Path(directory)
        # the weights' sha256 is checked while hf_directory.load reads them (below)
        flat, self.config = export.read(directory, later=hf_directory.is_weights_file)
        if self.config.get("strategy", {}).get("name") not in FAMILY:
            raise export.ExportError(
                f"{directory / export.MODEL_FILE}: not a packed-sft, two-stage, preference or grpo "
                f"export "
                f"(strategy {self.config.get('strategy')!r})"
            )
        self.directory = directory
        template = None  # a base-model run's chat template (prompts are rendered with it)
        if self.config.get("tokenizer", {}).get("kind") == pinned_base.EXPORT_TOKENIZER_KIND:
            try:
                tokenizer, template = pinned_base.exported_tokenizer(
                    directory, self.config["tokenizer"]
                )
            except pinned_base.BaseModelError as exc:
                raise export.ExportError(str(exc)) from None
        else:
            tokenizer = tokenizers.from_config(self.config["tokenizer"], directory)
        hf_config = None
        if "weights" in self.config:  # a HuggingFace directory (Llama architecture)
            cfg, params = hf_directory.load(directory, self.config, streamed)
            hf_config = loaded_model.read_config(directory)
        else:
            export.verify_files(directory, hf_directory.is_weights_file)  # any listed
            cfg = model.config_from_dict(self.config["model"])
            template_params = jax.eval_shape(lambda: model.init_params(cfg, jax.random.key(0)))
            template_params = jax.tree_util.tree_map(
                lambda a: np.zeros(a.shape, a.dtype), template_params
            )
            try:
                params = restore_like(template_params, flat)
            except ValueError as exc:
                raise export.ExportError(f"{directory}: {exc}") from exc
        try:
            defaults, stops = loaded_model.generation_settings(directory, tokenizer, hf_config)
        except loaded_model.ModelLoadError as exc:
            raise export.ExportError(str(exc)) from None
        super().__init__(cfg, params, tokenizer, template, defaults, stops, directory)

    def encode_dev(
        self,
        pinned_sha256: str | None,
        source: formats.Source | None = None,
        train_on: str = "all_assistant",
    ) -> list[encoding.Encoded]:
        """The export's copy of the DEV split, encoded as training encoded it (``source``,
        ``train_on``: the recipe's); it must be the file the export records and the recipe
        pins (``pinned_sha256``)."""
        dev_path = self.dev_file(pinned_sha256)
        examples = formats.read(dev_path, source).examples
        if self.template is not None:
            return pinned_base.encode_chat(
                examples, self.tokenizer, self.template, train_on, dev_path
            )
        return encoding.encode_examples(examples, self.tokenizer, train_on, dev_path)

    def dev_file(self, pinned_sha256: str | None) -> Path:
        """The export's copy of the DEV split, refused unless it is the file the export
        records and the recipe pins (``pinned_sha256``)."""
        dev = self.config["dev"]
        dev_path = self.directory / dev["file"]
        data = dev_path.read_bytes() if dev_path.is_file() else b""
        actual = sha256_bytes(data)
        if actual != dev["sha256"] or actual != pinned_sha256:
            raise export.ExportError(
                f"{dev_path}: sha256 {actual}, but the export records {dev['sha256']} and the "
                f"recipe pins {pinned_sha256}"
            )
        return dev_path

    def raw_ids(self, text: str) -> list[int]:
        """A base-model run's export: as any HF directory; else ``<bos> text``, the layout
        raw text trained in (a causal-LM stage's)."""
        if self.template is not None:
            return super().raw_ids(text)
        head = [] if self.tokenizer.bos_id is None else [self.tokenizer.bos_id]
        return [*head, *self.tokenizer.encode(text)]

    def prompt_ids(self, prompt, chat_template: bool = True) -> list[int]:
        """A prompt encoded as training laid it out: the chat template's user turn and
        generation prompt for a base-model run (messages too), ``<bos> prompt`` for a
        causal-LM stage (raw text continues), else ``<bos> prompt <sep>``;
        ``chat_template=False`` asks for the raw text (:meth:`raw_ids`)."""
        if self.template is not None and self.config.get("stage") != "pretrain":
            return super().prompt_ids(prompt, chat_template)
        text = loaded_model.single_user_text(prompt)
        if self.config.get("stage") == "pretrain" or not chat_template:
            return self.raw_ids(text)
        return encoding.encode(encoding.Example(text, "x"), self.tokenizer).prompt
