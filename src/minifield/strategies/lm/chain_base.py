"""A chain's downstream recipe made concrete: another computation's export as its base model.

A recipe with a pinned HF base model (``model.base``, e.g. the Llama demo) can start from
another computation's export instead of the files it names (config ``chains``,
docs/two-stage.md "Chains"). :func:`base_recipe` replaces every input ``model.base`` names by
the export's file of the same role, pinned by the sha256 the export's ``model.json`` lists
(each file is checked to have it), so the downstream computation and examples digests cover
the upstream model byte for byte (weights, config, tokenizer and its chat template). The
recipe keeps its input names and adds none (packed-sft accepts only the inputs it reads) but
for a sharded export's further shards and index, which its ``model.base`` then names,
so everything downstream (prepare, the worker, the store) reads it as an ordinary
base-model recipe; the lineage is the link's directory, addressed by the upstream
computation digest.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

from ...digest import sha256_file
from ...hf import checkpoint as hf_checkpoint
from ...hf import directory as hf_directory
from ...inputs.linked_root import LinkError
from ...state import export

#: ``model.base`` key -> the export's file of that role (a sharded export: its shards and index
#: instead of ``weights``, :func:`_sharded_weights`)
EXPORT_FILES = {
    "config": hf_checkpoint.CONFIG_FILE,
    "weights": hf_checkpoint.SINGLE_FILE,
    "tokenizer": hf_directory.TOKENIZER_FILE,
    "tokenizer_config": hf_directory.TOKENIZER_CONFIG_FILE,
    "generation_config": hf_directory.GENERATION_CONFIG_FILE,
}
#: where the export's files go under the downstream input root
PRODUCT_DIR = "chain"


def listed_files(export_dir: Path) -> dict[str, str]:
    """File name -> sha256 of an HF-directory export's ``model.json``; refuses anything else."""
    record_path = Path(export_dir) / export.MODEL_FILE
    if not record_path.is_file():
        raise LinkError(f"{record_path}: missing: no upstream export to start from")
    try:
        record = json.loads(record_path.read_text(encoding="utf-8"))
        if record.get("format") != export.FILES_FORMAT:
            raise ValueError(f"format {record.get('format')!r}, expected {export.FILES_FORMAT!r}")
        return {entry["file"]: entry["sha256"] for entry in record["files"]}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise LinkError(f"{record_path}: not an HF-directory export record ({exc})") from None


def _pinned(export_dir: Path, file_name: str, listed: dict[str, str]) -> str:
    path = Path(export_dir) / file_name
    if file_name not in listed:
        raise LinkError(
            f"{path}: the export's {export.MODEL_FILE} lists no {file_name} (the downstream "
            "recipe's model.base needs it)"
        )
    actual = sha256_file(path) if path.is_file() else None
    if actual != listed[file_name]:
        raise LinkError(f"{path}: sha256 {actual} is not the {listed[file_name]} model.json lists")
    return actual


def base_recipe(template: dict, export_dir: Path) -> dict:
    """``template`` (a recipe as written, with ``model.base``) starting from ``export_dir``."""
    base = (template.get("model") or {}).get("base")
    if not isinstance(base, dict):
        raise LinkError("the downstream recipe has no model.base for the export to replace")
    recipe = copy.deepcopy(template)
    base = recipe["model"]["base"]
    listed = listed_files(export_dir)
    items = {item["name"]: item for item in recipe.get("inputs", [])}
    # the base's weights become the export's: drop the template's further shards and index
    dropped = [*base["weights"][1:], *([base.pop("index")] if "index" in base else [])]
    base["weights"] = base["weights"][:1]
    recipe["inputs"] = [item for item in recipe["inputs"] if item["name"] not in dropped]
    roles = dict(EXPORT_FILES)
    if hf_checkpoint.INDEX_FILE in listed:  # a sharded export (evaluation.export_max_shard_size)
        del roles["weights"]
        _sharded_weights(recipe, export_dir, listed)
        items = {item["name"]: item for item in recipe["inputs"]}
    for key, file_name in roles.items():
        names = base.get(key)
        for name in names if isinstance(names, list) else [names] if names else []:
            items[name].clear()
            items[name].update(
                name=name,
                path=f"{PRODUCT_DIR}/{file_name}",
                sha256=_pinned(export_dir, file_name, listed),
            )
    return recipe


def _sharded_weights(recipe: dict, export_dir: Path, listed: dict[str, str]) -> None:
    """A sharded export's weights as the base's: its index and every shard it names, each
    pinned by the sha256 ``model.json`` lists; the first shard takes the weights input's name,
    the others ``<name>-2`` ... and the index ``<name>-index`` (the index names shards by file
    name, so each keeps its file name under the product directory)."""
    base = recipe["model"]["base"]
    first = base["weights"][0]
    index_path = Path(export_dir) / hf_checkpoint.INDEX_FILE
    index_sha = _pinned(export_dir, hf_checkpoint.INDEX_FILE, listed)
    try:
        shard_files = sorted(set(json.loads(index_path.read_text())["weight_map"].values()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise LinkError(f"{index_path}: not a safetensors index ({exc})") from None
    names = [first, *(f"{first}-{i}" for i in range(2, len(shard_files) + 1))]
    taken = {item["name"] for item in recipe["inputs"]} - {first}
    clash = sorted(taken & {*names, f"{first}-index"})
    if clash:
        raise LinkError(
            f"{index_path}: the sharded export's inputs would be named {clash[0]}, which the "
            "downstream recipe already names"
        )
    pins = [(name, file) for name, file in zip(names, shard_files, strict=True)]
    pins.append((f"{first}-index", hf_checkpoint.INDEX_FILE))
    recipe["inputs"] = [item for item in recipe["inputs"] if item["name"] != first]
    for name, file in pins:
        sha = index_sha if file == hf_checkpoint.INDEX_FILE else _pinned(export_dir, file, listed)
        recipe["inputs"].append({"name": name, "path": f"{PRODUCT_DIR}/{file}", "sha256": sha})
    base["weights"], base["index"] = names, f"{first}-index"
