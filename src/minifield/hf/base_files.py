"""An HF base model directory's files, found and named as a recipe's pinned inputs.

:func:`base_files` finds the files that form a base model (``config.json``,
``model.safetensors`` or the index and every shard it names, ``tokenizer.json``,
``tokenizer_config.json`` and, when present, ``generation_config.json``) and refuses a
directory that is not an HF model minifield reads (a family it does not fine-tune, a pickle
checkpoint, a missing file), naming the file; :func:`input_names` names the inputs that hold
them in a written recipe (the Llama demo's names). ``minifield recipe new --base`` uses both.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..models.families import ARCHITECTURES
from .config import MODEL_TYPES

#: ``model.base`` key -> the name of the input that holds it in a written recipe (the Llama
#: demo's names); shards of a sharded checkpoint are ``base-weights-1`` ... ``base-weights-N``
BASE_INPUTS = {
    "config": "base-config",
    "weights": "base-weights",
    "index": "base-index",
    "tokenizer": "base-tokenizer",
    "tokenizer_config": "base-tokenizer-config",
    "generation_config": "base-generation-config",
}
#: ``model.base`` key -> the HF file name of that role
BASE_FILES = {
    "config": "config.json",
    "weights": "model.safetensors",
    "index": "model.safetensors.index.json",
    "tokenizer": "tokenizer.json",
    "tokenizer_config": "tokenizer_config.json",
    "generation_config": "generation_config.json",
}
#: a chat template saved beside the tokenizer (transformers >= 4.47 writes it there)
CHAT_TEMPLATE_FILE = "chat_template.jinja"
PICKLE_SUFFIXES = (".bin", ".pt", ".ckpt", ".pth", ".pkl")
#: model keys that only restate the base's config.json (packed-sft checks them against it):
#: stated in a recipe about its own base, they are dropped with a new base
BASE_CONFIG_KEYS = (
    "d_model",
    "n_layers",
    "n_heads",
    "n_kv_heads",
    "d_ff",
    "rope_theta",
    "norm_eps",
    "qkv_bias",
    "tie_embeddings",
    "head_dim",
    "qk_norm",
    "sliding_window",
)


class BaseFilesError(ValueError):
    """Not an HF model directory minifield reads: the message names the file and what to do."""


def _json_file(path: Path) -> object:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise BaseFilesError(f"{path}: not readable JSON ({exc})") from None


def _check_family(config_path: Path) -> None:
    config = _json_file(config_path)
    if not isinstance(config, dict):
        raise BaseFilesError(f"{config_path}: expected a JSON object (an HF config.json)")
    model_type, archs = config.get("model_type"), config.get("architectures")
    known = model_type in MODEL_TYPES if isinstance(model_type, str) else None
    if known is None and isinstance(archs, list) and archs:
        known = archs[0] in ARCHITECTURES
    if not known:
        raise BaseFilesError(
            f"{config_path}: model_type {model_type!r} (architectures {archs!r}) is not a family "
            f"minifield fine-tunes (model_type one of {list(MODEL_TYPES)}; see "
            "docs/pretrained.md, families)"
        )


def _shards(index: Path) -> list[Path]:
    document = _json_file(index)
    weight_map = document.get("weight_map") if isinstance(document, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise BaseFilesError(f"{index}: not a safetensors index (no weight_map)")
    shards = []
    for name in sorted(set(map(str, weight_map.values()))):
        shard = index.parent / name
        if Path(name).name != name or Path(name).suffix != ".safetensors":
            raise BaseFilesError(
                f"{index}: names shard {name!r}, not a .safetensors file beside it"
            )
        if not shard.is_file():
            raise BaseFilesError(f"{shard}: missing (named by {index})")
        shards.append(shard)
    return shards


def has_chat_template(tokenizer_config: Path) -> bool:
    """Whether ``tokenizer_config.json`` holds a chat template (or a list with a default one)."""
    config = _json_file(tokenizer_config)
    if not isinstance(config, dict):
        raise BaseFilesError(f"{tokenizer_config}: expected a JSON object")
    template = config.get("chat_template")
    if isinstance(template, list):
        template = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = template.get("default")
    return isinstance(template, str) and bool(template)


def base_files(directory: Path) -> dict[str, list[Path] | Path]:
    """``model.base`` key -> the file(s) of the HF directory that play that role; refuses a
    directory that is not an HF model minifield reads (the message names the file)."""
    described = (
        "an HF model directory: config.json, model.safetensors (or model.safetensors.index.json "
        "and its shards), tokenizer.json, tokenizer_config.json"
    )
    if not directory.is_dir():
        state = "not a directory" if directory.exists() else "no such directory"
        raise BaseFilesError(f"--base {directory}: {state} (give {described})")
    files: dict[str, list[Path] | Path] = {}
    config = directory / BASE_FILES["config"]
    if not config.is_file():
        raise BaseFilesError(f"{config}: missing, so {directory} is not {described}")
    _check_family(config)
    files["config"] = config
    single, index = directory / BASE_FILES["weights"], directory / BASE_FILES["index"]
    if single.is_file():
        files["weights"] = [single]
    elif index.is_file():
        files["index"], files["weights"] = index, _shards(index)
    else:
        pickles = sorted(p.name for p in directory.iterdir() if p.suffix in PICKLE_SUFFIXES)
        if pickles:
            raise BaseFilesError(
                f"{directory / pickles[0]}: a pickle checkpoint, refused (unpickling runs "
                "arbitrary code); save the model as safetensors first (transformers: "
                "model.save_pretrained(DIR, safe_serialization=True))"
            )
        raise BaseFilesError(
            f"{single}: missing (nor {index.name}), so {directory} is not {described}"
        )
    for key in ("tokenizer", "tokenizer_config"):
        path = directory / BASE_FILES[key]
        if not path.is_file():
            raise BaseFilesError(
                f"{path}: missing, so {directory} is not {described} (minifield reads the fast "
                "tokenizer's files: AutoTokenizer.from_pretrained(...).save_pretrained(DIR) "
                "writes them)"
            )
        files[key] = path
    generation = directory / BASE_FILES["generation_config"]
    if generation.is_file():
        files["generation_config"] = generation
    return files


def input_names(key: str, count: int) -> list[str]:
    """The names of the inputs that hold ``count`` files of ``model.base`` key ``key``: one per
    shard of sharded weights (``base-weights-1`` ...), else the one name of the role."""
    if key == "weights" and count > 1:
        return [f"{BASE_INPUTS[key]}-{i}" for i in range(1, count + 1)]
    return [BASE_INPUTS[key]]
