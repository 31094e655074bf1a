"""Recipes: load (JSON or YAML), validate with defaults, and compute their digests.

Validation never stops at the first problem: every error is reported with a
JSON pointer to the offending field and a plain message. Defaults are filled
before the digest is computed, so spelling out a default does not change the
computation's identity.

A valid recipe is one the worker can honour: besides the schemas' bounds, every
number must be finite, an integer is a whole number (``8``, not ``8.0``),
``limits.deadline`` is RFC 3339 with a time zone (the ``date-time`` format is
really checked here: jsonschema alone would ignore it), and the step counter and
data cursor of the state (int32) must hold ``max_steps`` and
``max_steps × batch_size``. Importing this module does not import JAX.
"""

from __future__ import annotations

import copy
import datetime as dt
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jsonschema
import yaml

from . import schemas, strategies
from .digest import sha256_json
from .harness import tasks as harness_tasks
from .hf import quantized_base
from .strategies.base import EXTRA_SECTIONS, computation_digest

#: a recipe is a small document; anything larger is refused before parsing
MAX_RECIPE_BYTES = 1 << 20
#: the step counter and the data cursor of every strategy's state are int32 scalars
INT32_MAX = 2**31 - 1
#: the longest message kept per error (a huge offending value is not echoed whole)
_MAX_MESSAGE = 300
_RFC3339 = re.compile(r"^\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}(\.\d{1,6})?(Z|[+-]\d{2}:\d{2})$")


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

    @property
    def source_digests(self) -> dict[str, str]:
        """Training input name → digest of that source prepared on its own (empty for a
        recipe whose examples are prepared in one piece)."""
        specs = self.strategy.training_sources(self.data)
        return {name: sha256_json(spec) for name, spec in specs.items()}

    @property
    def quantized_base_digest(self) -> str | None:
        """The address of the quantized base the recipe trains on (None: its base is not
        quantized; :mod:`minifield.hf.quantized_base`)."""
        return quantized_base.digest(self.data)


load_schema = schemas.load


def parse_deadline(text: str) -> dt.datetime:
    """An RFC 3339 date-time with a time zone, as the worker reads ``limits.deadline``.

    Raises ValueError naming the expectation: the layout (upper-case ``T`` and
    ``Z``, at most 6 fractional digits, an offset or ``Z``), a real calendar
    date and time, and a moment that exists in UTC.
    """
    if not isinstance(text, str) or not _RFC3339.match(text):
        raise ValueError(
            "must be an RFC 3339 date-time with a time zone, e.g. 2030-01-01T00:00:00Z or "
            f"2030-01-01T02:00:00+02:00 (got {_short(repr(text))})"
        )
    try:
        moment = dt.datetime.fromisoformat(text.replace("Z", "+00:00"))
        moment.astimezone(dt.UTC)  # an offset that pushes it outside years 1-9999 overflows
    except (ValueError, OverflowError) as exc:
        raise ValueError(f"is not a real date and time ({exc}; got {text!r})") from None
    return moment


_FORMATS = jsonschema.FormatChecker(formats=())


@_FORMATS.checks("date-time", raises=ValueError)
def _is_date_time(instance) -> bool:
    if isinstance(instance, str):
        parse_deadline(instance)
    return True


def _with_defaults(validator_class):
    """A validator that fills ``default`` values of absent properties while validating, and
    whose ``integer`` is a whole number only: a float such as 8.0 would reach the step
    counter as a float and give another digest than 8."""
    validate_properties = validator_class.VALIDATORS["properties"]

    def set_defaults(validator, properties, instance, schema):
        if isinstance(instance, dict):
            for name, subschema in properties.items():
                if "default" in subschema and name not in instance:
                    instance[name] = copy.deepcopy(subschema["default"])
        yield from validate_properties(validator, properties, instance, schema)

    types = validator_class.TYPE_CHECKER.redefine(
        "integer", lambda _checker, value: isinstance(value, int) and not isinstance(value, bool)
    )
    return jsonschema.validators.extend(
        validator_class, {"properties": set_defaults}, type_checker=types
    )


_DefaultingValidator = _with_defaults(jsonschema.Draft202012Validator)


def _short(text: str) -> str:
    return text if len(text) <= _MAX_MESSAGE else text[: _MAX_MESSAGE - 3] + "..."


def _pointer(parts) -> str:
    return "".join("/" + str(p).replace("~", "~0").replace("/", "~1") for p in parts)


def _plain(error: jsonschema.ValidationError) -> tuple[str, str]:
    """(pointer, message) with the pointer naming the missing field for 'required'."""
    path = list(error.absolute_path)
    if error.validator == "required":
        missing = error.message.split("'")[1] if "'" in error.message else ""
        return _pointer([*path, missing]), "is required but missing"
    if error.validator in ("additionalProperties", "unevaluatedProperties"):
        # the same words whether the schema lists every key itself or shares some by $ref
        message = error.message.replace("Unevaluated properties", "Additional properties")
        return _pointer(path), f"{message} (check the spelling against the schema)"
    if error.validator == "oneOf" and path and "inputs" in [str(p) for p in path]:
        return _pointer(
            path
        ), "an input needs either 'path' (under the input root) or 'url' and 'size'"
    if error.validator == "format":
        return _pointer(path), str(error.cause or error.message)
    if error.validator == "pattern" and isinstance(error.instance, str):
        return _pointer(path), (
            f"{_short(repr(error.instance))} does not match the pattern {error.validator_value}"
        )
    message = error.message
    shown = repr(error.instance)
    if len(shown) > 80 and message.startswith(shown):
        # the offending value leads jsonschema's message; keep what is said about it whole
        message = shown[:60] + "..." + message[len(shown) :]
    return _pointer(path), _short(message)


class _Reported:
    """Placeholder for a value already reported as unrepresentable."""

    def __repr__(self) -> str:
        return "<reported>"


_REPORTED = _Reported()


def _unrepresentable(document: Any, path: tuple = ()) -> list[tuple[tuple, str]]:
    """Values no field can hold, found before the schema sees them: NaN and infinities (JSON's
    ``NaN``/``Infinity`` and YAML's ``.nan``/``.inf`` parse to them), integers too long
    (whose message alone could not be printed) and YAML timestamps (an unquoted date-time)."""
    found = []
    if isinstance(document, dict):
        for key, value in document.items():
            found += _unrepresentable(value, (*path, key))
    elif isinstance(document, list):
        for index, value in enumerate(document):
            found += _unrepresentable(value, (*path, index))
    elif isinstance(document, float) and not math.isfinite(document):
        found.append((path, f"must be a finite number (got {document!r})"))
    elif isinstance(document, int) and not isinstance(document, bool):
        if document.bit_length() > 9000:  # Python will not even print it (4300 digits)
            found.append((path, "is out of range (an integer of more than 2700 digits)"))
    elif isinstance(document, dt.date | dt.datetime):
        found.append(
            (
                path,
                "is a YAML timestamp; quote it so it stays text, e.g. "
                "deadline: '2030-01-01T00:00:00Z'",
            )
        )
    return found


def validate_document(document: Any, schema: dict, prefix: tuple = ()) -> list[dict]:
    """Validate in place (filling defaults); returns every error as {path, message}.

    A value no field can hold (NaN, an infinity, a huge integer, a YAML
    timestamp) is reported once, under its own pointer, and replaced by a
    placeholder before the schema runs, whose verdicts on the placeholder are
    dropped (the document is invalid either way).
    """
    errors = []
    for path, message in _unrepresentable(document):
        errors.append({"path": _pointer(prefix) + _pointer(path), "message": message})
        parent = document
        for part in path[:-1]:
            parent = parent[part]
        parent[path[-1]] = _REPORTED
    for error in sorted(
        _DefaultingValidator(
            schema, format_checker=_FORMATS, registry=schemas.registry()
        ).iter_errors(document),
        key=lambda e: list(map(str, e.absolute_path)),
    ):
        if error.instance is _REPORTED:
            continue
        pointer, message = _plain(error)
        errors.append({"path": _pointer(prefix) + pointer, "message": message})
    return errors


def read_document(path: str | Path) -> Any:
    """Parse a recipe file: ``.json`` as JSON, ``.yaml``/``.yml`` as YAML."""
    path = Path(path)

    def refuse(message: str) -> RecipeError:
        return RecipeError(str(path), [{"path": "", "message": message}])

    try:
        with path.open("rb") as handle:
            raw = handle.read(MAX_RECIPE_BYTES + 1)
    except OSError as exc:
        raise refuse(f"cannot read file ({exc.strerror or exc})") from exc
    if len(raw) > MAX_RECIPE_BYTES:
        raise refuse(f"larger than {MAX_RECIPE_BYTES} bytes; a recipe is a small document")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise refuse(
            f"not UTF-8 text (byte {exc.start}: {raw[exc.start : exc.start + 1]!r}); "
            "save the recipe as UTF-8"
        ) from None
    kind = "YAML" if path.suffix.lower() in (".yaml", ".yml") else "JSON"
    try:
        if kind == "YAML":
            return yaml.safe_load(text)
        return json.loads(text)
    except (ValueError, yaml.YAMLError, RecursionError) as exc:
        # ValueError covers JSONDecodeError and integers too long to convert (both readers)
        raise refuse(f"not valid {kind}: {_short(str(exc))}") from None


def _check_input_paths(recipe: dict) -> list[dict]:
    errors = []
    names = set()
    items = recipe.get("inputs")
    # a malformed inputs list or name is the schema's error to report; nothing to add here
    for index, item in enumerate(items if isinstance(items, list) else []):
        if not isinstance(item, dict):
            continue
        if isinstance(item.get("name"), str) and item["name"] in names:
            errors.append(
                {
                    "path": f"/inputs/{index}/name",
                    "message": f"duplicate input name {item['name']!r}",
                }
            )
        if isinstance(item.get("name"), str):
            names.add(item["name"])
        path = item.get("path")
        if isinstance(path, str) and (path.startswith("/") or ".." in Path(path).parts):
            errors.append(
                {
                    "path": f"/inputs/{index}/path",
                    "message": f"must be relative to the input root, without '..' (got {path!r})",
                }
            )
    return errors


def _check_counters(recipe: dict) -> list[dict]:
    """The state's int32 data cursor counts rows consumed: max_steps × batch_size must fit."""
    steps = recipe["limits"]["max_steps"]
    batch = recipe["training"].get("batch_size", 1)
    if isinstance(batch, int) and steps * batch > INT32_MAX:
        return [
            {
                "path": "/limits/max_steps",
                "message": f"{steps} updates of training.batch_size={batch} rows would consume "
                f"{steps * batch} rows, more than the state's int32 data cursor holds "
                f"({INT32_MAX}); at most {INT32_MAX // batch} updates",
            }
        ]
    return []


def _check_device_memory(data: dict, strategy) -> list[dict]:
    """``runtime.device_memory_bytes`` only where prepare checks a step against it (a strategy
    whose step is estimated, from a pinned base): elsewhere it would check nothing, silently."""
    if "device_memory_bytes" not in data.get("runtime", {}):
        return []
    if strategy.estimates_step_memory and "base" in data["model"]:
        return []
    message = (
        f"checked only for a packed-sft recipe with model.base (its step's estimated memory); "
        f"{strategy.name} {'with' if 'base' in data['model'] else 'without'} model.base checks "
        "nothing against it: leave it out"
    )
    return [{"path": "/runtime/device_memory_bytes", "message": message}]


def validate(document: Any, source: str = "<recipe>") -> Recipe:
    """Validate a parsed recipe; raises RecipeError listing every problem."""
    try:
        return _validate(document, source)
    except RecursionError:
        raise RecipeError(
            source, [{"path": "", "message": "nested too deeply to be a recipe"}]
        ) from None


def _validate(document: Any, source: str) -> Recipe:
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
        # a strategy's own sections (preference's): validated by its schema when given,
        # refused by every other strategy
        for key in strategy.extra_sections:
            if key in data:
                sections[key] = data[key]
        errors += [
            {"path": f"/{key}", "message": f"only for a strategy that has it (not {spec['name']})"}
            for key in EXTRA_SECTIONS
            if key in data and key not in strategy.extra_sections
        ]
        if all(isinstance(v, dict) for v in sections.values()):
            errors += validate_document(sections, load_schema(strategy.schema_file))
        if isinstance(data.get("limits"), dict):
            data["limits"].setdefault("max_steps", strategy.default_max_steps)
        if isinstance(data.get("checkpoint"), dict):
            data["checkpoint"].setdefault("every_steps", strategy.default_every_steps)
        if not errors:
            errors += strategy.check(data)
            errors += harness_tasks.recipe_errors(data)
            errors += _check_counters(data)
            errors += _check_device_memory(data, strategy)
    if errors:
        raise RecipeError(source, errors)
    return Recipe(
        data=data,
        strategy=strategy,
        computation_digest=computation_digest(data),
        examples_digest=sha256_json(strategy.data_spec(data)),
    )


def load(path: str | Path) -> Recipe:
    return validate(read_document(path), str(path))
