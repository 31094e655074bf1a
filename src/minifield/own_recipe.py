"""A recipe for your own data and base model, derived from a shipped one (``--like``).

:func:`derive` keeps every setting of the ``--like`` recipe except the inputs replaced (data
files by input name) and, given an HF base directory, its base model: the directory's files
(:mod:`.hf.base_files`) become the pinned inputs ``model.base`` names, the model keys that only
restate the old base's ``config.json`` are dropped and a chat template is taken where the
tokenizer has none. Every input is pinned (:func:`.inputs.repin.pin`); the caller validates
the result. :func:`dump` is the text a recipe file is written as; :func:`repinned_text`, an
edited recipe's text with new pins, its comments and layout kept where the pins can be replaced
in place. Problems are an :class:`OwnRecipeError` (or the :class:`.hf.base_files.BaseFilesError`
and :class:`.inputs.repin.PinError` of the files), naming the file.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import yaml

from .data import formats as data_formats
from .hf import base_files as hf_base
from .inputs import repin

#: the inputs --train, --dev and --test replace
DATA_FLAGS = ("train", "dev", "test")
#: what describes how a replaced data file is read: the --like recipe's file, not yours
READ_SETTINGS = ("format", "columns", "roles")


class OwnRecipeError(ValueError):
    """A recipe that cannot be derived as asked: the message says why and what to do."""


def is_yaml(path: Path) -> bool:
    return path.suffix.lower() in (".yaml", ".yml")


def dump(document: dict, path: Path, header: str = "") -> str:
    """The text of ``document`` as the recipe file ``path`` (YAML after ``header``, or JSON)."""
    if is_yaml(path):
        body = yaml.safe_dump(document, sort_keys=False, allow_unicode=True, width=100)
        return header + body
    return json.dumps(document, indent=2, ensure_ascii=False) + "\n"


def _parsed(text: str, path: Path) -> object:
    """``text`` read as ``path``'s format would be (None where it does not parse)."""
    try:
        return yaml.safe_load(text) if is_yaml(path) else json.loads(text)
    except (ValueError, yaml.YAMLError):
        return None


def repinned_text(
    text: str, path: Path, document: dict, updated: dict, local: list[tuple[int, dict]]
) -> tuple[str, bool]:
    """The recipe file ``path``'s new text (``text`` read as ``document``; ``updated`` and
    ``local`` from :func:`.inputs.repin.rehash`), and whether it kept the old text's comments
    and layout: only the pins replaced where the result parses as ``updated``, else the whole
    recipe written again."""
    edited = repin.replaced_pins(text, document, local)
    if edited is not None and _parsed(edited, path) == updated:
        return edited, True
    return dump(updated, path), False


def reward_columns(recipe: dict) -> dict[str, str]:
    """Column -> the first reward that reads it (``rl.rewards[i] (kind)``), of a validated grpo
    recipe; empty for another strategy."""
    if (recipe.get("strategy") or {}).get("name") != "grpo":
        return {}
    needed: dict[str, str] = {}
    for index, reward in enumerate((recipe.get("rl") or {}).get("rewards") or []):
        if isinstance(reward, dict) and isinstance(reward.get("column"), str):
            needed.setdefault(reward["column"], f"rl.rewards[{index}] ({reward.get('kind')})")
    return needed


def check_reward_columns(recipe: dict, files: dict[str, Path], advice: str) -> None:
    """Every row of a grpo recipe's prompt files (``files``: input name -> path) holds each
    column its rewards read, which the prepare stage refuses otherwise: an
    :class:`OwnRecipeError` naming ``file:line``, the column and the reward, then ``advice``."""
    needed = reward_columns(recipe)
    for name in DATA_FLAGS:
        if not needed or name not in files:
            continue
        try:
            for row, where in data_formats.rows(files[name], data_formats.Source()):
                missing = [c for c in needed if not isinstance(row, dict) or c not in row]
                if missing:
                    raise OwnRecipeError(
                        f"{where}: no column {missing[0]!r}, which {needed[missing[0]]} reads "
                        f"(input {name}); {advice}"
                    )
        except data_formats.DataError as exc:
            raise OwnRecipeError(str(exc)) from None


def input_names(like: dict) -> set:
    """The names of the recipe's inputs."""
    return {item.get("name") for item in like.get("inputs", []) if isinstance(item, dict)}


def _first_row_format(path: Path) -> str:
    """The supervised format of the file's first row (packed-sft's reader); refuses a file
    it cannot read, naming file and line."""
    source = data_formats.Source()
    try:
        for row, where in data_formats.rows(path, source):
            return data_formats.row_example(row, where, None, source, True)[1]
    except data_formats.DataError as exc:
        raise OwnRecipeError(str(exc)) from None
    raise OwnRecipeError(f"{path}: no examples (the file is empty)")


def _new_base(
    model: dict,
    like_path: Path,
    base_dir: Path,
    given: dict,
    names: set,
    root: Path,
    template_file: Path | None,
) -> tuple[set[str], list[dict], Path | None, list[str]]:
    """``model.base`` replaced by the HF directory's files (``model`` changed in place): the
    old base's input names, the new base's inputs (sha256 None), the chat template file to
    read (``template_file``, else the directory's where neither the recipe nor the tokenizer
    has one; None: none to read) and notes."""
    old_base, notes = model.get("base"), []
    if not isinstance(old_base, dict):
        raise OwnRecipeError(
            f"--like {like_path} trains its model from scratch (no model.base): --base needs "
            "a recipe that fine-tunes a base model, e.g. config/recipes/llama-sft-demo.yaml"
        )
    base_names: set[str] = set()
    for value in old_base.values():
        base_names.update(value if isinstance(value, list) else [value])
    overlap = sorted(base_names & set(given))
    if overlap:
        raise OwnRecipeError(
            f"--input {overlap[0]}=...: part of the --like recipe's model.base, which --base "
            "replaces whole; give the file in the --base directory instead"
        )
    files = hf_base.base_files(base_dir)
    taken = names - base_names
    base, new_base_inputs = {}, []
    for key, found in files.items():
        paths = found if isinstance(found, list) else [found]
        names_of_key = hf_base.input_names(key, len(paths))
        for name, path in zip(names_of_key, paths, strict=True):
            if name in taken:
                raise OwnRecipeError(
                    f"--like {like_path}: its input {name!r} is not part of its model.base, "
                    "but a new base model's file needs that name; rename it in a copy of "
                    "the recipe"
                )
            relative = repin.under_root(path, root, "--base")
            new_base_inputs.append({"name": name, "path": relative, "sha256": None})
        base[key] = names_of_key if key == "weights" else names_of_key[0]
    if (
        template_file is None
        and "chat_template" not in model
        and not hf_base.has_chat_template(files["tokenizer_config"])
    ):
        template_file = base_dir / hf_base.CHAT_TEMPLATE_FILE
        if not template_file.is_file():
            raise OwnRecipeError(
                f"{files['tokenizer_config']}: no chat_template (a base model often has "
                "none), and the --like recipe sets no model.chat_template: give one with "
                "--chat-template FILE (a Jinja template, e.g. the instruct model's "
                f"{hf_base.CHAT_TEMPLATE_FILE})"
            )
        notes.append(
            f"chat template: {template_file} (tokenizer_config.json has none), written "
            "into model.chat_template"
        )
    stated = [key for key in hf_base.BASE_CONFIG_KEYS if key in model]
    for key in stated:
        del model[key]
    if stated:
        notes.append(
            f"dropped model.{', model.'.join(stated)} of --like: the new base's config.json "
            "gives them"
        )
    model["base"] = base
    return base_names, new_base_inputs, template_file, notes


def derive(
    like: dict,
    like_path: Path,
    given: dict[str, Path],
    base_dir: Path | None,
    chat_template: Path | None,
    root: Path,
    job_id: str,
) -> tuple[dict, list[dict], list[str]]:
    """The new recipe from the (valid) ``like`` recipe read from ``like_path``: its inputs
    named in ``given`` replaced by those files, its base model by the HF directory
    ``base_dir``, ``chat_template`` read into ``model.chat_template``, every path relative to
    ``root`` and pinned, ``job_id`` its own; one row per pinned input, and notes to print."""
    document, notes = copy.deepcopy(like), []
    names = input_names(document)
    unknown = sorted(set(given) - names)
    if unknown:
        raise OwnRecipeError(
            f"--like {like_path} has no input named {unknown[0]!r} to replace (its inputs: "
            f"{sorted(n for n in names if isinstance(n, str))})"
        )
    model = document.get("model") if isinstance(document.get("model"), dict) else {}
    old_base = model.get("base")
    base_names: set[str] = set()
    new_base_inputs: list[dict] = []
    template_file = chat_template
    if base_dir is not None:
        base_names, new_base_inputs, template_file, base_notes = _new_base(
            model, like_path, base_dir, given, names, root, template_file
        )
        notes += base_notes
    if template_file is not None:
        if not isinstance(old_base, dict):
            raise OwnRecipeError(
                "--chat-template: only for a recipe with a base model (model.base)"
            )
        try:
            model["chat_template"] = template_file.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise OwnRecipeError(
                f"{template_file}: cannot read the chat template ({exc})"
            ) from None
    strategy = (document.get("strategy") or {}).get("name")
    inputs: list[dict] = []
    formats: dict[Path, str] = {}
    for item in document.get("inputs", []):
        name = item.get("name")
        if name in base_names:
            inputs += new_base_inputs  # where the old base's first file was; once
            new_base_inputs = []
            continue
        if name in given:
            flag = f"--{name}" if name in DATA_FLAGS else f"--input {name}="
            path = given[name]
            if not path.is_file():
                state = "not a file" if path.exists() else "no such file"
                raise OwnRecipeError(f"{flag} {path}: {state}")
            relative = repin.under_root(path, root, flag.rstrip("="))
            dropped = [key for key in READ_SETTINGS if key in item]
            if dropped:
                notes.append(
                    f"input {name}: dropped {', '.join(dropped)} of --like (they described its "
                    "file; yours is detected from its first row)"
                )
            item = {"name": name, "path": relative, "sha256": None}
            if strategy == "packed-sft" and name in DATA_FLAGS and path not in formats:
                formats[path] = _first_row_format(path)
                notes.append(
                    f"{path}: rows read as {formats[path]!r} (detected from its first row)"
                )
        inputs.append(item)
    document["inputs"] = inputs
    rows = repin.pin(document, root, like_path)
    product = document.get("product")
    if isinstance(product, dict) and product.get("name"):
        notes.append(
            f"product {product.get('name')!r} {product.get('version')!r} is the --like "
            "recipe's: the store and MLflow register the model under it; edit product for yours"
        )
    document["job_id"] = job_id
    document.pop("attempt_id", None)  # an execution's identity, never reused
    return _ordered(document, like), rows, notes


def _ordered(document: dict, like: dict) -> dict:
    """``document`` with ``job_id`` first and the rest in the --like recipe's order."""
    order = ["job_id", *(key for key in like if key != "job_id")]
    out = {key: document[key] for key in order if key in document}
    out.update({key: value for key, value in document.items() if key not in out})
    return out
