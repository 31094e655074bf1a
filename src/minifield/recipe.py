"""Recipes: load (JSON or YAML), validate with defaults, and compute their digests.

Validation never stops at the first problem: every error is reported with a
JSON pointer to the offending field and a plain message. Defaults are filled
before the digest is computed, so spelling out a default does not change the
computation's identity.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import jsonschema
import yaml

from . import strategies
from .digest import sha256_json


class RecipeError(Exception):
    """An invalid recipe; ``errors`` holds every problem found."""

    def __init__(self, source: str, errors: list[dict]):
        self.source = source
        self.errors = errors
        lines = "\n".join(f"  {e['path'] or '/'}: {e['message']}" for e in errors)
        super().__init__(f"{source}: invalid recipe ({len(errors)} problem(s)):\n{lines}")


@dataclass(frozen=True)
class Recipe:
    data: dict  # the validated recipe, defaults filled in
    strategy: strategies.Strategy
    computation_digest: str
    examples_digest: str

    @property
    def job_id(self) -> str:
        return self.data["job_id"]


def load_schema(name: str) -> dict:
    return json.loads(resources.files("minifield.schemas").joinpath(name).read_text("utf-8"))


def _with_defaults(validator_class):
    """A validator that fills ``default`` values of absent properties while validating."""
    validate_properties = validator_class.VALIDATORS["properties"]

    def set_defaults(validator, properties, instance, schema):
        if isinstance(instance, dict):
            for name, subschema in properties.items():
                if "default" in subschema and name not in instance:
                    instance[name] = copy.deepcopy(subschema["default"])
        yield from validate_properties(validator, properties, instance, schema)

    return jsonschema.validators.extend(validator_class, {"properties": set_defaults})


_DefaultingValidator = _with_defaults(jsonschema.Draft202012Validator)


def _pointer(parts) -> str:
    return "".join("/" + str(p).replace("~", "~0").replace("/", "~1") for p in parts)


def _plain(error: jsonschema.ValidationError) -> tuple[str, str]:
    """(pointer, message) with the pointer naming the missing field for 'required'."""
    path = list(error.absolute_path)
    if error.validator == "required":
        missing = error.message.split("'")[1] if "'" in error.message else ""
        return _pointer([*path, missing]), "is required but missing"
    if error.validator == "additionalProperties":
        return _pointer(path), f"{error.message} (check the spelling against the schema)"
    if error.validator == "oneOf" and path and "inputs" in [str(p) for p in path]:
        return _pointer(
            path
        ), "an input needs either 'path' (under the input root) or 'url' and 'size'"
    return _pointer(path), error.message


def validate_document(document: Any, schema: dict, prefix: tuple = ()) -> list[dict]:
    """Validate in place (filling defaults); returns every error as {path, message}."""
    errors = []
    for error in sorted(
        _DefaultingValidator(schema).iter_errors(document),
        key=lambda e: list(map(str, e.absolute_path)),
    ):
        pointer, message = _plain(error)
        errors.append({"path": _pointer(prefix) + pointer, "message": message})
    return errors


def read_document(path: str | Path) -> Any:
    """Parse a recipe file: ``.json`` as JSON, ``.yaml``/``.yml`` as YAML."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise RecipeError(
            str(path), [{"path": "", "message": f"cannot read file ({exc.strerror})"}]
        ) from exc
    try:
        if path.suffix.lower() in (".yaml", ".yml"):
            return yaml.safe_load(text)
        return json.loads(text)
    except (json.JSONDecodeError, yaml.YAMLError) as exc:
        raise RecipeError(
            str(path),
            [{"path": "", "message": f"not valid {path.suffix[1:].upper() or 'JSON'}: {exc}"}],
        ) from exc


def _check_input_paths(recipe: dict) -> list[dict]:
    errors = []
    names = set()
    for index, item in enumerate(recipe.get("inputs", [])):
        if not isinstance(item, dict):
            continue
        if item.get("name") in names:
            errors.append(
                {
                    "path": f"/inputs/{index}/name",
                    "message": f"duplicate input name {item['name']!r}",
                }
            )
        names.add(item.get("name"))
        path = item.get("path")
        if isinstance(path, str) and (path.startswith("/") or ".." in Path(path).parts):
            errors.append(
                {
                    "path": f"/inputs/{index}/path",
                    "message": f"must be relative to the input root, without '..' (got {path!r})",
                }
            )
    return errors


def computation_fields(data: dict) -> dict:
    """What defines the computation: not ids, roots, runtime placement or operational limits."""
    return {
        "strategy": data["strategy"],
        "inputs": sorted(
            ({"name": i["name"], "sha256": i["sha256"]} for i in data["inputs"]),
            key=lambda i: i["name"],
        ),
        "model": data["model"],
        "training": data["training"],
        "limits": {"max_steps": data["limits"]["max_steps"]},
        "evaluation": data["evaluation"],
    }


def validate(document: Any, source: str = "<recipe>") -> Recipe:
    """Validate a parsed recipe; raises RecipeError listing every problem."""
    if not isinstance(document, dict):
        raise RecipeError(source, [{"path": "", "message": "a recipe must be a JSON/YAML object"}])
    data = copy.deepcopy(document)
    errors = validate_document(data, load_schema("recipe.schema.json"))
    errors += _check_input_paths(data)
    strategy = None
    spec = data.get("strategy")
    if (
        isinstance(spec, dict)
        and isinstance(spec.get("name"), str)
        and isinstance(spec.get("version"), str)
    ):
        strategy = strategies.get(spec["name"], spec["version"])
        if strategy is None:
            known = ", ".join(f"{s.name} {s.version}" for s in strategies.available())
            errors.append(
                {
                    "path": "/strategy",
                    "message": f"unknown strategy {spec['name']} {spec['version']} (known: {known})",
                }
            )
    if strategy is not None:
        sections = {k: data.setdefault(k, {}) for k in ("model", "training", "evaluation")}
        if all(isinstance(v, dict) for v in sections.values()):
            errors += validate_document(sections, load_schema(strategy.schema_file))
        if isinstance(data.get("limits"), dict):
            data["limits"].setdefault("max_steps", strategy.default_max_steps)
        if isinstance(data.get("checkpoint"), dict):
            data["checkpoint"].setdefault("every_steps", strategy.default_every_steps)
        if not errors:
            errors += strategy.check(data)
    if errors:
        raise RecipeError(source, errors)
    return Recipe(
        data=data,
        strategy=strategy,
        computation_digest=sha256_json(computation_fields(data)),
        examples_digest=sha256_json(strategy.data_spec(data)),
    )


def load(path: str | Path) -> Recipe:
    return validate(read_document(path), str(path))
