"""Stage 2's start: the stage-1 export, pinned file by file, checked and loaded.

A stage-2 recipe names the files of the stage-1 export in ``model.init.stage1`` (each a
pinned input, so their sha256 enter the stage-2 computation and examples digests) together
with the stage-1 computation digest it expects. Prepare refuses, naming the file, unless:

- ``model.json`` (the export's own record) is a ``two-stage`` pretrain export of exactly that
  computation digest (another digest: a result of another stage-1 computation);
- every other pinned file has the sha256 ``model.json`` lists for it (no file from elsewhere);
- the stage-2 tokenizer is stage 1's: the same ``tokenizer.json`` bytes (the built-in byte
  tokenizer's file is generated, a ``tokenizers-json`` one is the pinned file) and the same
  special tokens;
- the dimensions the stage-2 recipe states equal the export's ``config.json``.

Every problem is a :class:`Stage1Error`, an :class:`~minifield.inputs.pinned.InputError`: the
worker exits 2 in the ``examples`` phase and the prepare rule fails; nothing is trained.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import numpy as np

from ...data import tokenizer as tokenizers
from ...digest import sha256_bytes
from ...hf import checkpoint as hf_checkpoint
from ...hf import directory as hf_directory
from ...hf import pinned_base, stored_base
from ...inputs.pinned import InputError
from ...state import export

#: ``model.init.stage1`` key -> the export file it names
FILES = {
    "record": export.MODEL_FILE,
    "config": hf_checkpoint.CONFIG_FILE,
    "weights": hf_checkpoint.SINGLE_FILE,
    "tokenizer": hf_directory.TOKENIZER_FILE,
}
#: prepared-array prefix of the stage-1 parameters (the same layout as a base model's)
PARAM_PREFIX = pinned_base.PARAM_PREFIX


class Stage1Error(InputError):
    """A stage-1 export stage 2 cannot start from; the message names the file and reason."""


def input_names(model: dict) -> list[str]:
    stage1 = (model.get("init") or {}).get("stage1")
    return [stage1[key] for key in FILES] if stage1 else []


def _record(path: Path, expected_digest: str, strategy_name: str) -> dict:
    try:
        record = json.loads(path.read_bytes().decode("utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise Stage1Error(f"{path}: not a readable export record ({exc})") from None
    config = record.get("config") if isinstance(record, dict) else None
    if record.get("format") != export.FILES_FORMAT or not isinstance(config, dict):
        raise Stage1Error(f"{path}: not the model.json of an HF-format export")
    strategy = config.get("strategy") or {}
    if strategy.get("name") != strategy_name or config.get("stage") != "pretrain":
        raise Stage1Error(
            f"{path}: not a stage-1 export (strategy {strategy!r}, stage {config.get('stage')!r}; "
            f"expected {strategy_name} stage pretrain)"
        )
    recorded = config.get("computation_digest")
    if recorded != expected_digest:
        raise Stage1Error(
            f"{path}: the export is the result of stage-1 computation {recorded}, but the recipe's "
            f"model.init.stage1.computation_digest is {expected_digest} (another stage-1 result)"
        )
    return record


def check_tokenizer(record: dict, tokenizer_path: Path, stage2_tokenizer, stage2_json: bytes):
    """The stage-2 tokenizer must be the one stage 1 trained with."""
    theirs = tokenizer_path.read_bytes()
    if sha256_bytes(theirs) != sha256_bytes(stage2_json):
        raise Stage1Error(
            f"{tokenizer_path}: tokenizer mismatch between the stages: stage 1 trained with this "
            f"tokenizer.json (sha256 {sha256_bytes(theirs)}), the stage-2 recipe's "
            f"model.tokenizer ({stage2_tokenizer.kind}) is another (sha256 "
            f"{sha256_bytes(stage2_json)})"
        )
    recorded = record["config"].get("tokenizer") or {}
    ours = stage2_tokenizer.config(hf_directory.TOKENIZER_FILE)
    if recorded.get("kind") == "tokenizers-json" and recorded.get("special_tokens") != ours.get(
        "special_tokens"
    ):
        raise Stage1Error(
            f"{tokenizer_path}: tokenizer mismatch between the stages: stage 1's special tokens "
            f"{recorded.get('special_tokens')} differ from stage 2's {ours.get('special_tokens')}"
        )


def load(recipe: dict, files: dict[str, Path], tokenizer, tokenizer_json: bytes, strategy_name):
    """Check the stage-1 export and return its FP32 parameters as prepared arrays."""
    model = recipe["model"]
    stage1 = model["init"]["stage1"]
    paths = {key: files[stage1[key]] for key in FILES}
    record = _record(paths["record"], stage1["computation_digest"], strategy_name)
    listed = {entry.get("file"): entry.get("sha256") for entry in record.get("files", [])}
    for key, file_name in FILES.items():
        if key == "record":
            continue
        actual = sha256_bytes(paths[key].read_bytes())
        if listed.get(file_name) != actual:
            what = "tokenizer mismatch between the stages: " if key == "tokenizer" else ""
            raise Stage1Error(
                f"{paths[key]}: {what}sha256 {actual} is not the {file_name} of the stage-1 "
                f"export {paths['record']} (which lists {listed.get(file_name)})"
            )
    check_tokenizer(record, paths["tokenizer"], tokenizer, tokenizer_json)
    with tempfile.TemporaryDirectory(prefix="minifield-stage1-") as tmp:
        directory = Path(tmp)
        for key in ("config", "weights"):
            (directory / FILES[key]).symlink_to(paths[key].resolve())
        try:
            cfg, params = hf_checkpoint.load(
                directory, recipe["training"]["seq_len"], model["compute_dtype"]
            )
        except (hf_checkpoint.CheckpointError, OSError) as exc:
            message = str(exc).replace(str(directory), f"stage-1 export {paths['record'].parent}")
            raise Stage1Error(message) from None
    if cfg.vocab_size != tokenizer.vocab_size:
        raise Stage1Error(
            f"{paths['config']}: vocab_size {cfg.vocab_size}, but the stage-2 tokenizer has "
            f"{tokenizer.vocab_size} ids (tokenizer mismatch between the stages)"
        )
    try:
        pinned_base.check_recipe_agrees(model, cfg, paths["config"])
    except pinned_base.BaseModelError as exc:
        raise Stage1Error(str(exc)) from None
    arrays = {
        PARAM_PREFIX + path.replace("/", "."): np.asarray(value, dtype=np.float32)
        for path, value in stored_base.flatten(params)
    }
    description = {
        "computation_digest": stage1["computation_digest"],
        "record_sha256": sha256_bytes(paths["record"].read_bytes()),
        "config": cfg.to_dict(),
    }
    return arrays, description


def stage2_tokenizer_json(tokenizer, files: dict[str, Path], settings: dict) -> bytes:
    """The ``tokenizer.json`` a stage-2 run with these tokenizer settings exports."""
    if tokenizer.kind == "byte":
        return hf_directory.byte_tokenizer_json()
    return files[settings.get("input", "tokenizer")].read_bytes()


__all__ = ["FILES", "Stage1Error", "input_names", "load", "stage2_tokenizer_json", "tokenizers"]
