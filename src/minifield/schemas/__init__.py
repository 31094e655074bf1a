"""The JSON Schemas (recipes, strategies, the config, the proof) and how they are read.

The schemas are the one place a recipe's defaults live: ``default`` is filled in by
validation (:mod:`minifield.recipe`); ``x-absent`` is the value an absent key means where the
schema has no default, so that the key stays absent from recipes written before it existed
(their computation digest unchanged): the strategy fills it in or removes it itself
(:func:`absent`). The two supervised strategies share their training block,
``strategy-training.schema.json``, by ``$ref``; :func:`registry` resolves it. Importing this
module does not import JAX.
"""

from __future__ import annotations

import functools
import json
from importlib import resources

from referencing import Registry, Resource
from referencing.jsonschema import DRAFT202012

SUFFIX = ".schema.json"


def strategy_file(name: str) -> str:
    """The schema of strategy ``name``'s recipe sections (model, training, evaluation and its
    own): ``strategy-{name}.schema.json``."""
    return f"strategy-{name}{SUFFIX}"


#: the packed-sft strategy's schema (its ``x-absent`` values are read by the model code too)
PACKED_SFT = strategy_file("packed-sft")
#: the training block packed-sft and two-stage share (the optimizer's defaults)
TRAINING = "strategy-training.schema.json"


@functools.cache
def _text(name: str) -> str:
    return resources.files(__name__).joinpath(name).read_text("utf-8")


def load(name: str) -> dict:
    """The schema file ``name`` (a fresh copy: callers may change it)."""
    return json.loads(_text(name))


@functools.cache
def registry() -> Registry:
    """Every schema of this package under its ``$id``, for validators to resolve ``$ref``."""
    found = []
    for entry in resources.files(__name__).iterdir():
        if entry.name.endswith(SUFFIX):
            schema = load(entry.name)
            found.append((schema["$id"], Resource(schema, DRAFT202012)))
    return Registry().with_resources(found)


def defaults(name: str) -> dict:
    """``{key: default}`` of the top-level properties of schema ``name`` that have one."""
    return {k: p["default"] for k, p in load(name)["properties"].items() if "default" in p}


def absent(name: str, section: str) -> dict:
    """``{key: value}`` an absent key of ``section`` in schema ``name`` means (``x-absent``)."""
    properties = load(name)["properties"][section]["properties"]
    return {k: p["x-absent"] for k, p in properties.items() if "x-absent" in p}
