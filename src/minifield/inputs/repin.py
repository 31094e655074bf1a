"""Pinning a recipe's local inputs under the input root: a new recipe's, an edited one's again.

:func:`under_root` turns a path given on the command line into a recipe path (relative to the
input root, refusing one outside it); :func:`pin` hashes a new recipe's inputs and checks the
ones it kept against their pins; :func:`rehash` re-hashes an edited recipe's local inputs and
:func:`changed_pins` lists what that changed; :func:`replaced_pins` puts the new pins into the
recipe's text, leaving its comments and layout as they were. Problems are a
:class:`PinError` whose message names the input and the file.
"""

from __future__ import annotations

import copy
import os
import re
import shlex
from pathlib import Path

from ..digest import sha256_file
from . import pinned

_HEX64 = re.compile(r"^[0-9a-f]{64}$")


class PinError(ValueError):
    """An input that cannot be pinned: outside the input root, missing, or not as pinned."""


def under_root(path: Path, root: Path, flag: str) -> str:
    """``path`` (as given, relative to the working directory) as a recipe path: relative to
    ``root``, POSIX separators; refuses a path outside the root, saying what to do."""
    for candidate, base in (
        (Path(os.path.abspath(path)), Path(os.path.abspath(root))),
        (path.resolve(), root.resolve()),
    ):
        try:
            relative = candidate.relative_to(base).as_posix()
            break
        except ValueError:
            continue
    else:
        suggestion = root / path.name
        raise PinError(
            f"{flag} {path}: outside the input root {root} (recipe paths are relative to it, "
            f"without '..' or absolute paths). Copy it there, e.g. `cp -r {shlex.quote(str(path))} "
            f"{shlex.quote(str(suggestion))}`, and give {flag} {suggestion}; or pass "
            "--input-root (the pipeline must use the same one: config input_root)"
        )
    if relative == ".":
        raise PinError(f"{flag} {path}: is the input root itself, not a file under it")
    try:
        pinned.resolve(root, relative)
    except pinned.InputError as exc:  # a symlink leaving the root
        raise PinError(
            f"{flag} {path}: {exc}; copy the file itself under the input root (the worker "
            "refuses a symlink that leaves it)"
        ) from None
    return relative


def _resolved(root: Path, name, where: str, problems: list[str]) -> Path | None:
    """A local input's file under ``root``; None, its problem added, when it is refused (absolute, or outside the root)."""
    try:
        return pinned.resolve(root, where)
    except pinned.InputError as exc:
        problems.append(f"input {name!r}: {exc}")
        return None


def pin(document: dict, root: Path, like: Path) -> list[dict]:
    """Hash every local input written by ``recipe new`` (sha256 None) and check every one kept
    from the --like recipe against its pin; one row per input."""
    rows, problems, absent = [], [], []
    for item in document["inputs"]:
        if "path" not in item:
            rows.append({"name": item["name"], "path": item.get("url"), "sha256": item["sha256"]})
            continue
        path = _resolved(root, item["name"], item["path"], problems)
        if path is None:
            continue
        if not path.is_file():
            absent.append(f"{item['name']} ({root / item['path']})")
            continue
        actual = sha256_file(path)
        if item["sha256"] is None:
            item["sha256"] = actual
        elif actual != item["sha256"]:
            problems.append(
                f"input {item['name']!r} (kept from --like {like}): {root / item['path']} has "
                f"sha256 {actual}, but --like pins {item['sha256']}; give the file with a flag, "
                "or write the recipe and run `minifield recipe repin` on it"
            )
            continue
        rows.append({"name": item["name"], "path": item["path"], "sha256": actual})
    if absent:
        problems.append(
            f"--like {like} keeps inputs whose files are not under the input root {root}: "
            f"{', '.join(absent)}; give yours (--base, --train, --dev, --test, --input "
            "NAME=FILE) or put those files there"
        )
    if problems:
        raise PinError("; ".join(problems))
    return rows


def rehash(document: dict, root: Path, path: Path) -> tuple[dict, list[tuple[int, dict]]]:
    """A copy of the recipe ``document`` (read from ``path``) with every local input pinned to
    its file's sha256 now, and each local input of the copy with its index."""
    items = document.get("inputs")
    if not isinstance(items, list) or not all(isinstance(item, dict) for item in items):
        raise PinError(f"{path}: inputs is not a list of {{name, path, sha256}} entries")
    updated = copy.deepcopy(document)
    local = [(i, item) for i, item in enumerate(updated["inputs"]) if "path" in item]
    hashes, problems = {}, []
    for _, item in local:
        name, where = item.get("name"), item.get("path")
        file = _resolved(root, name, str(where), problems)
        if file is None:
            continue
        if not file.is_file():
            problems.append(f"input {name!r}: {root / str(where)} does not exist")
            continue
        if file not in hashes:
            hashes[file] = sha256_file(file)
        item["sha256"] = hashes[file]
    if problems:
        raise PinError(f"{path}: " + "; ".join(problems) + f" (input root {root}); nothing written")
    return updated, local


def changed_pins(
    document: dict, local: list[tuple[int, dict]]
) -> list[tuple[str, str, str | None, str]]:
    """``(name, path, old sha256, new sha256)`` of each input of :func:`rehash`'s ``local``
    whose pin differs from ``document``'s."""
    return [
        (item["name"], item["path"], document["inputs"][i].get("sha256"), item["sha256"])
        for i, item in local
        if document["inputs"][i].get("sha256") != item["sha256"]
    ]


def _path_line(text: str, cursor: int, path: str) -> re.Match | None:
    """The next block-style YAML line ``path: PATH`` (quoted or not, a list item's first key
    or not) from ``cursor``."""
    pattern = re.compile(
        r"^(?P<indent>[ \t]*)(?P<dash>-[ \t]+)?path:[ \t]*(?P<q>['\"]?)"
        + re.escape(path)
        + r"(?P=q)[ \t]*(?:#.*)?$",
        re.M,
    )
    return pattern.search(text, cursor)


def _missing_pin(text: str, cursor: int, item: dict, new: str) -> tuple[str, int] | None:
    """The text from ``cursor`` up to and including the pin of ``item`` (an input whose
    ``sha256`` is absent or not a hash: ``null``, ``""``), written after its ``path:``
    line or in place of its ``sha256:`` line's value; the cursor after it. None where the
    input is not written in block style."""
    found = _path_line(text, cursor, str(item.get("path")))
    if found is None:
        return None
    column = len(found["indent"]) + len(found["dash"] or "")
    if "sha256" in item:  # a placeholder value on a line of its own
        line = re.compile(r"^[ \t]*(?:-[ \t]+)?sha256:[ \t]*[^\n#]*?[ \t]*(?=#|$)", re.M)
        value = line.search(text, cursor)
        if value is None:
            return None
        key = value[0].index("sha256:") + len("sha256:")
        return text[cursor : value.start()] + value[0][:key] + f" {new}", value.end()
    return text[cursor : found.end()] + "\n" + " " * column + f"sha256: {new}", found.end()


def replaced_pins(text: str, document: dict, local: list[tuple[int, dict]]) -> str | None:
    """The recipe ``text`` (``document`` as read) with each local input's pin replaced by the
    one in :func:`rehash`'s ``local``, found in order (a missing pin written after the input's
    ``path:`` line); None where a pin is not found as written."""
    out, cursor = [], 0
    for i, item in local:
        before, after = document["inputs"][i].get("sha256"), item["sha256"]
        if isinstance(before, str) and _HEX64.match(before):
            at = text.find(before, cursor)
            if at < 0:
                return None
            out += [text[cursor:at], after]
            cursor = at + len(before)
            continue
        written = _missing_pin(text, cursor, document["inputs"][i], after)
        if written is None:
            return None
        out.append(written[0])
        cursor = written[1]
    return "".join(out) + text[cursor:]
