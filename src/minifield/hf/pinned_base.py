"""A pinned HF base model as a recipe input: ``model.base`` names the inputs that form it.

Prepare checks the base model once: its files (each a pinned input, so its sha256 is in the
computation and examples digests) are linked into a private directory under their HF file
names, :func:`.checkpoint.load_stored` reads the weights (safetensors only, every shape
checked against ``config.json``), and the tensors go into the prepared examples as stored —
their dtype, HF's layout (:mod:`.stored_base`) — as ``base.<parameter path>`` arrays beside the raw ``config.json``, ``tokenizer.json`` and
``tokenizer_config.json`` bytes. Training starts from those arrays, so the worker never
re-reads the checkpoint and a resumed attempt starts from the same bits.

Every problem is a :class:`BaseModelError`, an :class:`~minifield.inputs.pinned.InputError`: the
worker ends with exit 2 (invalid inputs) and the prepare rule fails, naming file and reason.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import numpy as np

from ..data import chat_template, encode_pool, encoding
from ..data import tokenizer as tokenizers
from ..inputs.pinned import InputError, location
from ..models import execution, lora_targets
from . import base_fit, stored_base
from . import checkpoint as hf_checkpoint

PARAM_PREFIX = stored_base.PARAM_PREFIX
CONFIG_ARRAY, TOKENIZER_ARRAY, TOKENIZER_CONFIG_ARRAY = (
    "base_config_json",
    "tokenizer_json",
    "tokenizer_config_json",
)
#: a pinned ``model.base.generation_config`` (only then: other recipes keep their examples)
GENERATION_CONFIG_ARRAY = "generation_config_json"


#: recipe model key -> config.json field it must agree with (:func:`check_recipe_agrees`)
BASE_CONFIG_FIELDS = {
    "d_model": ("d_model", "hidden_size"),
    "n_layers": ("n_layers", "num_hidden_layers"),
    "n_heads": ("n_heads", "num_attention_heads"),
    "n_kv_heads": ("n_kv_heads", "num_key_value_heads"),
    "d_ff": ("d_ff", "intermediate_size"),
    "rope_theta": ("rope_theta", "rope_theta"),
    "norm_eps": ("norm_eps", "rms_norm_eps"),
    "qkv_bias": ("qkv_bias", "architectures (Qwen2: q/k/v biases)"),
    "tie_embeddings": ("tie_embeddings", "tie_word_embeddings"),
    "head_dim": ("head_dim", "head_dim"),
    "qk_norm": ("qk_norm", "model_type (Qwen3: q/k norms)"),
    "sliding_window": ("sliding_window", "sliding_window"),
}


class BaseModelError(InputError):
    """A base model this project cannot train from; the message names the file and reason."""


def _input_items(recipe: dict) -> dict[str, dict]:
    return {item["name"]: item for item in recipe.get("inputs", [])}


def _link_directory(recipe: dict, files: dict[str, Path], directory: Path) -> None:
    """Link the base model's inputs into ``directory`` under the names the loader expects:
    ``config.json``, ``model.safetensors`` (one weights file, no index) or, with an index,
    ``model.safetensors.index.json`` and every shard under its own file name (the index names
    shards by file name)."""
    base, items = recipe["model"]["base"], _input_items(recipe)
    for name in base["weights"]:
        if Path(location(items[name])).suffix in hf_checkpoint.PICKLE_SUFFIXES:
            raise BaseModelError(
                f"{files[name]}: pickle checkpoints are refused (unpickling runs arbitrary code); "
                "pin the model's safetensors files instead"
            )
    links = {hf_checkpoint.CONFIG_FILE: base["config"]}
    if "index" in base:
        links[hf_checkpoint.INDEX_FILE] = base["index"]
        for name in base["weights"]:
            links[Path(location(items[name])).name] = name
    else:
        if len(base["weights"]) != 1:
            raise BaseModelError(
                f"model.base.weights names {len(base['weights'])} files but no index: a sharded "
                f"checkpoint needs model.base.index ({hf_checkpoint.INDEX_FILE})"
            )
        links[hf_checkpoint.SINGLE_FILE] = base["weights"][0]
    for file_name, input_name in links.items():
        (directory / file_name).symlink_to(files[input_name])


def check_recipe_agrees(recipe_model: dict, cfg, config_path: Path) -> None:
    """Every model key the recipe states must equal what ``config.json`` says."""
    for key, (attribute, field) in BASE_CONFIG_FIELDS.items():
        if key in recipe_model and recipe_model[key] != getattr(cfg, attribute):
            raise BaseModelError(
                f"{config_path}: {field} gives {key}={getattr(cfg, attribute)!r}, but the recipe "
                f"states model.{key}={recipe_model[key]!r} (leave it out or make them agree)"
            )


def _check_lora_targets(section: dict, cfg, config_path: Path) -> None:
    """Each of ``model.lora.targets`` names a module of this base (PEFT's suffix match: a
    Mixtral's experts are ``w1``/``w3``/``w2``, a Qwen-MoE's or OLMoE's ``gate_proj``/...;
    ``gate`` the router of a mixture)."""
    unmatched = lora_targets.unmatched_targets(cfg, section["targets"])
    if unmatched:
        model_type = json.loads(config_path.read_text()).get("model_type")
        names = [n for n in lora_targets.TARGETS if not lora_targets.unmatched_targets(cfg, [n])]
        raise BaseModelError(
            f"{config_path}: model_type {model_type} has no module named "
            f"{', '.join(unmatched)}: model.lora.targets must name its modules "
            f"({', '.join(names)})"
        )


def check_config(recipe: dict, files: dict[str, Path], step_memory: bool = False) -> None:
    """What the base's ``config.json`` alone refuses, before any tensor is read
    (:mod:`.base_fit`); ``step_memory``: packed-sft's step against the device's memory."""
    config_path = files[recipe["model"]["base"]["config"]]
    problem = base_fit.problem(recipe, config_path, step_memory)
    if problem:
        raise BaseModelError(f"{config_path}: {problem}")


def load(
    recipe: dict, files: dict[str, Path], without_router_loss: str | None = None
) -> tuple[dict[str, np.ndarray], dict]:
    """Check and convert the base model; returns its prepared arrays and a description.
    ``without_router_loss``: the name of a strategy whose loss has no router terms, which
    refuses a base asking for them (``output_router_logits`` true)."""
    model = recipe["model"]
    base = model["base"]
    seq_len = recipe["training"]["seq_len"]
    from safetensors import SafetensorError

    check_config(recipe, files)  # before the weights are read
    with tempfile.TemporaryDirectory(prefix="minifield-base-") as tmp:
        directory = Path(tmp)
        _link_directory(recipe, files, directory)
        try:
            # as stored (dtype, layout): a LoRA run holds them so; full fine-tuning widens
            cfg, params, stored_layout = hf_checkpoint.load_stored(
                directory, seq_len, model["compute_dtype"]
            )
        except (hf_checkpoint.CheckpointError, SafetensorError, OSError) as exc:
            # name the pinned files, not the private links
            message = str(exc)
            for link in sorted(directory.iterdir(), key=lambda p: -len(str(p))):
                target = link.resolve()
                named = str(target) if target.name == link.name else f"{target} (as {link.name})"
                message = message.replace(str(link), named)
            weights = ", ".join(str(files[name]) for name in base["weights"])
            message = message.replace(str(directory), f"base model weights {weights}")
            if not isinstance(exc, hf_checkpoint.CheckpointError):
                message = f"base model weights {weights}: not readable ({message})"
            raise BaseModelError(message) from None
    config_path = files[base["config"]]
    check_recipe_agrees(model, cfg, config_path)
    _check_router_loss(model, cfg, config_path, without_router_loss)
    try:  # what the recipe's execution options cannot run (a window in the fused kernel)
        execution.with_recipe_options(cfg, recipe)
    except ValueError as exc:
        raise BaseModelError(f"{config_path}: {exc}") from None
    if "lora" in model and cfg.fused_projections:
        # PEFT adapters name q_proj, gate_proj, ...; Phi-3 has qkv_proj, gate_up_proj instead
        raise BaseModelError(
            f"{config_path}: model_type phi3 stores qkv_proj and gate_up_proj fused; LoRA "
            "(model.lora) on them is not supported (full fine-tuning is)"
        )
    if "lora" in model:
        _check_lora_targets(model["lora"], cfg, config_path)
        config = _read_json(config_path)
        problem = stored_base.quantization_problem(
            model["lora"], cfg, config, params, stored_layout
        )
        if problem:
            raise BaseModelError(f"{config_path}: {problem}")
    arrays = stored_base.to_arrays(params, stored_layout)
    arrays[CONFIG_ARRAY] = np.frombuffer(config_path.read_bytes(), dtype=np.uint8)
    arrays[TOKENIZER_ARRAY] = np.frombuffer(files[base["tokenizer"]].read_bytes(), dtype=np.uint8)
    arrays[TOKENIZER_CONFIG_ARRAY] = np.frombuffer(
        files[base["tokenizer_config"]].read_bytes(), dtype=np.uint8
    )
    if "generation_config" in base:  # carried into the export byte for byte
        path = files[base["generation_config"]]
        _read_json(path)
        arrays[GENERATION_CONFIG_ARRAY] = np.frombuffer(path.read_bytes(), dtype=np.uint8)
    counted = (a.size for name, a in arrays.items() if name != stored_base.LAYOUT_ARRAY)
    description = {"config": cfg.to_dict(), "parameters": int(sum(counted))}
    return arrays, description


def _check_router_loss(model: dict, cfg, config_path: Path, without: str | None) -> None:
    """The router's training losses (docs/moe.md) need experts, and a strategy that adds
    them."""
    if model.get("router_z_loss_coef") and not cfg.n_experts:
        raise BaseModelError(
            f"{config_path}: the model has no experts, so model.router_z_loss_coef (a "
            "router's z-loss) does not apply; leave it out"
        )
    if without and cfg.router_aux_coef is not None:
        raise BaseModelError(
            f"{config_path}: output_router_logits true asks for the router's load-balancing "
            f"loss, which {without} does not add to its loss; set it false (packed-sft "
            "adds it)"
        )


def _read_json(path: Path) -> dict:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise BaseModelError(f"{path}: not readable JSON ({exc})") from None
    if not isinstance(value, dict):
        raise BaseModelError(f"{path}: expected a JSON object")
    return value


def params_from_arrays(arrays: dict[str, np.ndarray], by_slices: bool = False) -> dict:
    """The nested FP32 parameter tree the prepared ``base.*`` arrays hold (host numpy, this
    project's layout: :func:`.stored_base.host_fp32`; ``by_slices``: converted as placed)."""
    return stored_base.host_fp32(arrays, by_slices)


def base_config(arrays: dict[str, np.ndarray]) -> dict:
    """The base model's ``config.json`` as prepared (what an export carries over)."""
    return json.loads(np.asarray(arrays[CONFIG_ARRAY]).tobytes())


def config_from_arrays(recipe: dict, arrays: dict[str, np.ndarray]):
    return hf_checkpoint.config_from_hf(
        base_config(arrays),
        f"base model {recipe['model']['base']['config']}",
        recipe["training"]["seq_len"],
        recipe["model"]["compute_dtype"],
    )


def tokenizer_and_template(
    recipe: dict, tokenizer_json: bytes, tokenizer_config: bytes, where: dict[str, str], vocab: int
):
    """The base model's tokenizer and chat template (the recipe's ``chat_template`` wins).

    ``where`` names the two files for messages; ``vocab`` is the embedding's row count, which
    every token id must fit.
    """
    try:
        config = json.loads(tokenizer_config.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise BaseModelError(f"{where['tokenizer_config']}: not readable JSON ({exc})") from None
    if not isinstance(config, dict):
        raise BaseModelError(f"{where['tokenizer_config']}: expected a JSON object")
    try:
        tokenizer, strings = tokenizers.from_base_model(
            tokenizer_json, config, where["tokenizer"], where["tokenizer_config"]
        )
    except tokenizers.TokenizerError as exc:
        raise BaseModelError(str(exc)) from None
    check_vocab(tokenizer, vocab, where["tokenizer"])
    source, template_where = recipe["model"].get("chat_template"), "recipe model.chat_template"
    if source is None:
        source, template_where = (
            config_template(config, where["tokenizer_config"]),
            where["tokenizer_config"],
        )
    try:
        template = chat_template.ChatTemplate(
            source, strings, template_where, positions=recipe["training"]["seq_len"]
        )
    except chat_template.ChatTemplateError as exc:
        raise BaseModelError(str(exc)) from None
    return tokenizer, template


def tokenizer_from_files(recipe: dict, files: dict[str, Path]):
    """:func:`tokenizer_from_arrays` on the pinned files' bytes, before the weights are loaded
    (the arrays :func:`load` would hold for them are these bytes)."""
    base = recipe["model"]["base"]
    arrays = {
        name: np.frombuffer(files[base[key]].read_bytes(), dtype=np.uint8)
        for name, key in (
            (CONFIG_ARRAY, "config"),
            (TOKENIZER_ARRAY, "tokenizer"),
            (TOKENIZER_CONFIG_ARRAY, "tokenizer_config"),
        )
    }
    return tokenizer_from_arrays(recipe, arrays, files)


def check_vocab(tokenizer, vocab: int, where: str) -> None:
    """Every id of the tokenizer (``where`` names its file) must fit the model's ``vocab``
    embedding rows."""
    largest = max(tokenizer.backend.get_vocab(with_added_tokens=True).values()) + 1
    if max(largest, tokenizer.vocab_size) > vocab:
        raise BaseModelError(
            f"{where}: the tokenizer has ids up to {largest - 1} "
            f"({tokenizer.vocab_size} tokens), more than the model's embedding holds "
            f"(vocab_size {vocab} in config.json)"
        )


def tokenizer_from_arrays(recipe: dict, arrays: dict[str, np.ndarray], files=None):
    """The base model's tokenizer and chat template, from the prepared arrays (``files``:
    the pinned input files, named in messages when given)."""
    base = recipe["model"]["base"]
    where = {
        k: str(files[base[k]]) if files else f"base model input {base[k]!r}"
        for k in ("tokenizer", "tokenizer_config")
    }
    return tokenizer_and_template(
        recipe,
        np.asarray(arrays[TOKENIZER_ARRAY]).tobytes(),
        np.asarray(arrays[TOKENIZER_CONFIG_ARRAY]).tobytes(),
        where,
        config_from_arrays(recipe, arrays).vocab_size,
    )


def encode_chat(
    examples: list[encoding.Example],
    tokenizer,
    template,
    train_on: str,
    path: Path,
    processes: int = 1,
) -> list[encoding.Encoded]:
    """Examples of the supervised file ``path`` rendered with the base model's chat template
    (:func:`minifield.data.encode_pool.encode_examples`; a failure is a bad input, naming the file and
    example). ``processes``: how many processes render (:mod:`minifield.data.encode_pool`; the result is
    the same for any)."""
    job = encode_pool.ChatJob(tokenizer, template, train_on, path)
    try:
        return encode_pool.encode(examples, job, processes)
    except chat_template.ChatTemplateError as exc:
        raise BaseModelError(str(exc)) from None


def read_and_encode_chat(
    path: Path, source, tokenizer, template, train_on: str, processes: int = 1
) -> tuple[list[encoding.Encoded], dict]:
    """:func:`encode_chat` of every example of ``path`` read with ``source`` (on the workers,
    :func:`minifield.data.encode_pool.read_and_encode`), and the format decision the manifest records."""
    job = encode_pool.ChatJob(tokenizer, template, train_on, path)
    try:
        return encode_pool.read_and_encode(source, job, processes)
    except chat_template.ChatTemplateError as exc:
        raise BaseModelError(str(exc)) from None


def config_template(config: dict, where: str) -> str:
    """The chat template a ``tokenizer_config.json`` gives (of named templates, the one
    transformers uses by default)."""
    source = config.get("chat_template")
    if isinstance(source, list):
        named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
        source = named.get("default")
    if not isinstance(source, str) or not source:
        raise BaseModelError(
            f"{where}: no chat_template (set model.chat_template in the recipe to give one)"
        )
    return source


#: ``tokenizer.kind`` an export of a base-model run records: the base model's own
#: ``tokenizer.json`` and ``tokenizer_config.json`` (with the chat template) sit in the export
EXPORT_TOKENIZER_KIND = "base-model"


def export_tokenizer_config(recipe: dict, tokenizer_config: bytes) -> bytes:
    """The ``tokenizer_config.json`` an export carries: the base model's file byte for byte,
    or with ``chat_template`` replaced by the recipe's ``model.chat_template`` (the template
    the run was trained with, which transformers' ``apply_chat_template`` then uses)."""
    override = recipe["model"].get("chat_template")
    if override is None:
        return tokenizer_config
    config = json.loads(tokenizer_config.decode("utf-8"))
    config["chat_template"] = override
    return (json.dumps(config, indent=2, ensure_ascii=False) + "\n").encode("utf-8")


def exported_tokenizer(directory: Path, settings: dict, template_required: bool = True):
    """``(tokenizer, chat template)`` of an export recorded with ``EXPORT_TOKENIZER_KIND``
    (or of an HF directory: ``settings`` names its two files); a damaged file is a
    :class:`BaseModelError` naming it. Without ``template_required`` a file with no
    ``chat_template`` gives None for the template."""
    tokenizer_path = directory / settings["file"]
    config_path = directory / settings["config_file"]
    try:
        tokenizer_json = tokenizer_path.read_bytes()
        config = json.loads(config_path.read_bytes().decode("utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise BaseModelError(f"{directory}: unreadable tokenizer files ({exc})") from None
    if not isinstance(config, dict):
        raise BaseModelError(f"{config_path}: expected a JSON object")
    try:
        tokenizer, strings = tokenizers.from_base_model(
            tokenizer_json, config, str(tokenizer_path), str(config_path)
        )
        template = None
        if template_required or config.get("chat_template"):
            template = chat_template.ChatTemplate(
                config_template(config, str(config_path)), strings, str(config_path)
            )
    except (tokenizers.TokenizerError, chat_template.ChatTemplateError) as exc:
        raise BaseModelError(str(exc)) from None
    return tokenizer, template
