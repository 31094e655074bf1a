"""packed-sft's recipe settings: what the ``model`` section means, and what it selects.

- the strategy's identity (its name and version say what the sections mean; exports record it);
- one spelling per computation (:func:`normalize_model_section`, :func:`normalize_export_dtype`,
  :func:`normalize_export_shards`):
  a key absent from the recipe and the same key spelled at its "absent" value are one
  computation, so the spelled default is removed or, where the schema has no default, the
  value an absent key means is filled in here (recipes written before a key existed keep
  their computation digest);
- the cross-field checks of the model section the schema cannot express;
- the model config, tokenizer and chat template a prepared recipe selects.

The values an absent key means are the schema's: each such property carries them as
``x-absent`` (an annotation validation ignores and never fills in, see
:mod:`minifield.schemas`). This module does not import JAX (recipes are checked without it).
"""

from __future__ import annotations

import numpy as np

from ... import schemas
from ...data import tokenizer as tokenizers
from ...hf import pinned_base, shards

#: the held-out and training splits a language-model recipe names as inputs
SPLITS = ("train", "dev", "test")
NAME, VERSION = "packed-sft", "12.0.0"
SCHEMA_FILE = schemas.PACKED_SFT

#: model keys only the Llama architecture reads
LLAMA_KEYS = ("rope_theta", "norm_eps", "qkv_bias")
#: Llama keys added later: never filled in (recipes without them keep their digest), a value
#: spelled at what absence means removed
OPTIONAL_LLAMA_KEYS = ("head_dim", "qk_norm", "sliding_window")
#: model keys whose absence :func:`minifield.models.execution.normalize_recipe` reads (on a
#: TPU an absent ``attention`` is the faster kernel at the row length): never filled in here
EXECUTION_KEYS = ("attention",)
#: base-model keys added later: never filled in, a value spelled at what absence means removed
OPTIONAL_BASE_KEYS = ("router_z_loss_coef",)


def absent_values(section: str) -> dict:
    """``{key: value}`` an absent key of ``section`` means (the schema's ``x-absent``)."""
    return schemas.absent(SCHEMA_FILE, section)


def normalize_model_section(model: dict) -> list[dict]:
    """Give the model section one spelling per computation; returns errors.

    ``architecture`` has no schema default so that every recipe written before it keeps its
    computation digest: ``gpt`` (the default) is removed, and a Llama section gets its
    defaults filled here (``n_kv_heads`` = ``n_heads``), floats as floats, and loses
    ``positions`` (Llama is always rotary). With ``base`` (a pinned base model) nothing is
    filled in: the dimensions come from its ``config.json`` at prepare, and the keys the
    recipe states are kept to be checked against it there.
    """
    absent = absent_values("model")
    for key in OPTIONAL_BASE_KEYS:
        if key in model and model[key] == absent[key]:
            del model[key]
    if "base" in model:
        return _normalize_base_section(model)
    errors = [
        {"path": f"/model/{key}", "message": "only with model.base (a pinned base model)"}
        for key in ("chat_template", *OPTIONAL_BASE_KEYS)
        if key in model
    ]
    for key, value in absent.items():
        if key not in LLAMA_KEYS + OPTIONAL_LLAMA_KEYS + OPTIONAL_BASE_KEYS + EXECUTION_KEYS:
            model.setdefault(key, value)
    if model.get("architecture", "gpt") == "gpt":
        model.pop("architecture", None)
        return errors + [
            {"path": f"/model/{key}", "message": "only for model.architecture llama"}
            for key in ("n_kv_heads", *LLAMA_KEYS, *OPTIONAL_LLAMA_KEYS)
            if key in model
        ]
    if model.get("qk_norm") is absent["qk_norm"]:
        del model["qk_norm"]
    if model.get("head_dim") == model["d_model"] // model["n_heads"]:
        if model["d_model"] % model["n_heads"] == 0:
            del model["head_dim"]
    model.setdefault("n_kv_heads", model["n_heads"])
    for key in LLAMA_KEYS:
        model.setdefault(key, absent[key])
    model["rope_theta"], model["norm_eps"] = float(model["rope_theta"]), float(model["norm_eps"])
    model.pop("positions", None)
    if model["n_heads"] % model["n_kv_heads"]:
        errors.append(
            {
                "path": "/model/n_kv_heads",
                "message": f"must divide model.n_heads={model['n_heads']} "
                f"(got {model['n_kv_heads']})",
            }
        )
    return errors


def llama_only(model: dict, why: str) -> list[dict]:
    """``model.architecture`` given its default (llama), refused (for ``why``) when another."""
    if model.setdefault("architecture", "llama") != "llama":
        return [{"path": "/model/architecture", "message": why}]
    return []


def _normalize_base_section(model: dict) -> list[dict]:
    errors = llama_only(
        model,
        "a base model (model.base) is a Llama-family checkpoint: architecture must be llama "
        "or absent",
    )
    if "positions" in model:
        errors.append({"path": "/model/positions", "message": "not with model.base (rotary)"})
    tokenizer = model.pop("tokenizer", {"kind": "byte"})
    if tokenizer.get("kind") != "byte" or tokenizer.get("special_tokens"):
        errors.append(
            {
                "path": "/model/tokenizer",
                "message": "not with model.base: the base model's tokenizer.json and "
                "tokenizer_config.json are used (model.base.tokenizer, tokenizer_config)",
            }
        )
    for key in ("rope_theta", "norm_eps"):
        if key in model:
            model[key] = float(model[key])
    return errors


def model_errors(model: dict) -> list[dict]:
    """Shapes and tokenizer settings the schema cannot check (after normalisation)."""
    errors = []
    if "d_model" not in model or "n_heads" not in model:
        pass  # a base model's config.json gives them (checked at prepare)
    elif "head_dim" in model:
        if model["head_dim"] % 2:
            errors.append({"path": "/model/head_dim", "message": "rotary needs an even head width"})
    elif model["d_model"] % model["n_heads"]:
        errors.append(
            {
                "path": "/model/n_heads",
                "message": f"must divide model.d_model={model['d_model']} (got {model['n_heads']})",
            }
        )
    elif (
        model.get("positions", "rotary") == "rotary" and (model["d_model"] // model["n_heads"]) % 2
    ):
        errors.append(
            {
                "path": "/model/positions",
                "message": "rotary positions need an even head width (d_model / n_heads)",
            }
        )
    if model.get("qkv_bias") and model.get("qk_norm"):
        # the export's config.json names one family, and none has both (it would be
        # written as Qwen3 without the biases and not read back)
        errors.append(
            {
                "path": "/model/qk_norm",
                "message": "not with model.qkv_bias: no HF family has both q/k/v biases "
                "(Qwen2) and q/k norms (Qwen3); choose one",
            }
        )
    tokenizer = model.get("tokenizer", {"kind": "byte"})
    if tokenizer["kind"] == "byte" and (tokenizer.get("special_tokens") or {}):
        errors.append(
            {
                "path": "/model/tokenizer/special_tokens",
                "message": "only for kind tokenizers-json (the byte tokenizer's are fixed)",
            }
        )
    return errors


def router_loss_errors(strategy: str, model: dict) -> list[dict]:
    """A strategy whose loss has no router terms refuses ``model.router_z_loss_coef``."""
    if "router_z_loss_coef" not in model:
        return []
    return [
        {
            "path": "/model/router_z_loss_coef",
            "message": f"{strategy} does not add the router's losses to its loss (packed-sft "
            "does); leave it out",
        }
    ]


def warmup_errors(recipe: dict) -> list[dict]:
    """The warmup must end before the last update."""
    warmup, steps = recipe["training"]["warmup_steps"], recipe["limits"]["max_steps"]
    if warmup < steps:
        return []
    return [
        {
            "path": "/training/warmup_steps",
            "message": f"must be below limits.max_steps={steps} (got {warmup})",
        }
    ]


def exact_inputs_errors(strategy: str, wanted: list[str], recipe: dict) -> list[dict]:
    """The error of a recipe whose pinned inputs are not exactly ``wanted`` (the strategy
    accepts only the inputs it reads), or none."""
    names = [i["name"] for i in recipe.get("inputs", [])]
    missing = [n for n in wanted if n not in names]
    unknown = [n for n in names if n not in wanted]
    if not missing and not unknown:
        return []
    return [
        {
            "path": "/inputs",
            "message": f"{strategy} needs exactly the pinned inputs {wanted}; "
            f"missing {missing}, unexpected {unknown}",
        }
    ]


def base_model_inputs(model: dict) -> list[str]:
    """Names of the pinned inputs that form the base model (empty without one)."""
    base = model.get("base")
    if not base:
        return []
    names = [base["config"], *base["weights"], base["tokenizer"], base["tokenizer_config"]]
    return names + [base[key] for key in ("index", "generation_config") if key in base]


def export_dtype(recipe: dict) -> str:
    """The stored tensor type of an HF export (``evaluation.export_dtype``, absent: float32)."""
    return recipe["evaluation"].get("export_dtype", absent_values("evaluation")["export_dtype"])


def normalize_export_dtype(recipe: dict) -> list[dict]:
    """``evaluation.export_dtype`` has no schema default, so recipes written before it keep
    their digest: the default (float32) is removed. Another value is part of the
    computation digest (through the evaluation section) because it changes the published
    bytes and the figures the gate re-evaluates from them. Only a Llama model has it (the
    GPT model's export is the project's own FP32 format)."""
    evaluation = recipe["evaluation"]
    if export_dtype(recipe) == absent_values("evaluation")["export_dtype"]:
        evaluation.pop("export_dtype", None)
        return []
    if recipe["model"].get("architecture") != "llama":
        return [
            {
                "path": "/evaluation/export_dtype",
                "message": "only for model.architecture llama (the GPT export is FP32 .npy)",
            }
        ]
    return []


def export_max_shard_size(recipe: dict) -> int:
    """The largest safetensors file of an HF export, in bytes
    (``evaluation.export_max_shard_size``, absent: Hugging Face's 5GB)."""
    value = recipe["evaluation"].get(
        "export_max_shard_size", absent_values("evaluation")["export_max_shard_size"]
    )
    return shards.parse_size(value)


def normalize_export_shards(recipe: dict) -> list[dict]:
    """``evaluation.export_max_shard_size``: one spelling per size (bytes: ``"500MB"`` and
    500000000 are one computation), the absent value (5GB) removed so recipes written before
    it keep their digest. Another size is part of the computation digest: it changes the
    published files. Only a Llama model has it (the GPT export is FP32 ``.npy`` files)."""
    evaluation = recipe["evaluation"]
    if "export_max_shard_size" not in evaluation:
        return []
    path = "/evaluation/export_max_shard_size"
    try:
        size = shards.parse_size(evaluation["export_max_shard_size"])
    except ValueError as exc:
        return [{"path": path, "message": str(exc)}]
    if size == shards.parse_size(absent_values("evaluation")["export_max_shard_size"]):
        evaluation.pop("export_max_shard_size")
        return []
    evaluation["export_max_shard_size"] = size
    if recipe["model"].get("architecture") != "llama":
        return [
            {
                "path": path,
                "message": "only for model.architecture llama (the GPT export is FP32 .npy)",
            }
        ]
    return []


def model_config(recipe: dict, vocab_size: int):
    """The model config a normalised model section without a base model describes."""
    section = recipe["model"]
    if "base" in section:
        raise ValueError("a base model's config comes from its config.json (base_model_config)")
    keys = ["d_model", "n_layers", "n_heads", "d_ff", "tie_embeddings", "compute_dtype"]
    if section.get("architecture") == "llama":
        from ...models.llama_config import LlamaConfig as Config

        keys += ["n_kv_heads", *LLAMA_KEYS]
        keys += [key for key in OPTIONAL_LLAMA_KEYS if key in section]
    else:
        from ...models.gpt import ModelConfig as Config

        keys += ["positions"]
    values = {key: section[key] for key in keys}
    return Config(vocab_size=vocab_size, max_len=recipe["training"]["seq_len"], **values)


def tokenizer_of(recipe: dict, arrays: dict[str, np.ndarray]):
    """``(tokenizer, chat template or None)`` a prepared recipe encodes with."""
    if "base" in recipe["model"]:
        return pinned_base.tokenizer_from_arrays(recipe, arrays)
    settings = recipe["model"]["tokenizer"]
    if settings["kind"] == "byte":
        return tokenizers.byte_tokenizer(), None
    tokenizer_json = np.asarray(arrays["tokenizer_json"]).tobytes()
    return tokenizers.from_bytes(tokenizer_json, settings.get("special_tokens")), None


def config_of(recipe: dict, arrays: dict[str, np.ndarray], tokenizer):
    """The model config of a prepared recipe: a base model's ``config.json``, else the
    recipe's model section over the tokenizer's vocabulary."""
    if "base" in recipe["model"]:
        cfg = pinned_base.config_from_arrays(recipe, arrays)
        if "router_z_loss_coef" not in recipe["model"]:
            return cfg
        import dataclasses

        z_coef = float(recipe["model"]["router_z_loss_coef"])
        return dataclasses.replace(cfg, router_z_coef=z_coef)  # checked at prepare
    return model_config(recipe, tokenizer.vocab_size)
