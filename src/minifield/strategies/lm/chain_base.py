"""A chain's downstream recipe made concrete: another computation's export as its base model.

A recipe with a pinned HF base model (``model.base``, e.g. the Llama demo) can start from
another computation's export instead of the files it names (config ``chains``,
docs/two-stage.md "Chains"). :func:`base_recipe` replaces every input ``model.base`` names by
the export's file of the same role, pinned by the sha256 the export's ``model.json`` lists
(each file is checked to have it), so the downstream computation and examples digests cover
the upstream model byte for byte (weights, config, tokenizer and its chat template). The
recipe keeps its input names and adds none (packed-sft accepts only the inputs it reads),
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

#: ``model.base`` key -> the export's file of that role (one weights file: exports are whole)
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
    # a sharded base becomes the export's single weights file: drop the index and the shards
    dropped = [*base["weights"][1:], *([base.pop("index")] if "index" in base else [])]
    base["weights"] = base["weights"][:1]
    recipe["inputs"] = [item for item in recipe["inputs"] if item["name"] not in dropped]
    for key, file_name in EXPORT_FILES.items():
        names = base.get(key)
        for name in names if isinstance(names, list) else [names] if names else []:
            items[name].clear()
            items[name].update(
                name=name,
                path=f"{PRODUCT_DIR}/{file_name}",
                sha256=_pinned(export_dir, file_name, listed),
            )
    return recipe
