"""The workflow config checked against its schema before Snakemake reads any of it.

Snakemake's own ``validate`` reports a bad value as a schema dump and exits 1; a user who
mistyped ``evaluate.processes: 0`` needs the file, the field and what it must be, and the
exit status of every other refused input (2). The schema is the same one ``validate``
then fills the defaults from (``config.schema.json``, the one place they live).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

import jsonschema

from .. import schemas
from .computations import ConfigError

SCHEMA = "config.schema.json"
#: the exit status of a refused input, as the worker's and the commands'
EXIT_INVALID = 2


def _field(error: jsonschema.ValidationError) -> str:
    """The dotted name of the field an error is about (``required``: the missing one)."""
    parts = [str(p) for p in error.absolute_path]
    if error.validator == "required" and "'" in error.message:
        parts.append(error.message.split("'")[1])
    return ".".join(parts) or "(the whole config)"


def problems(config: dict, sources: Sequence[str]) -> list[str]:
    """One line per value ``config`` (read from ``sources``) has against the schema, each
    naming the file(s), the field and the expectation; empty when it is valid."""
    validator = jsonschema.Draft202012Validator(schemas.load(SCHEMA), registry=schemas.registry())
    where = ", ".join(map(str, sources)) or "the workflow config (--config)"
    lines = []
    for error in validator.iter_errors(config):
        message = error.message
        if error.validator == "additionalProperties":
            message += " (check the spelling against config/README.md)"
        lines.append((_field(error), message))
    return [f"{where}: {field}: {message}" for field, message in sorted(lines)]


def check(config: dict, sources: Sequence[str]) -> None:
    """Raise :class:`ConfigError` listing every problem of ``config`` (see :func:`problems`)."""
    found = problems(config, sources)
    if found:
        raise ConfigError("invalid workflow config:\n" + "\n".join(found))


def require_valid(config: dict, sources: Sequence[str]) -> None:
    """:func:`check`, for the Snakefile: a refused config is said on stderr and ends the
    run with exit status 2 before any rule is read (no traceback)."""
    try:
        check(config, sources)
    except ConfigError as exc:
        print(f"minifield: {exc}", file=sys.stderr)
        raise SystemExit(EXIT_INVALID) from None
