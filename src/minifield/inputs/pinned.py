"""Pinned inputs: resolve each under the input root and verify its sha256 before use.

A local input is found at its ``path``; a remote input (``url``) is found at its
``name`` once ``fetch_inputs`` has placed it in the input root.
"""

from __future__ import annotations

from pathlib import Path

from ..digest import sha256_file


class InputError(Exception):
    """A pinned input that is missing, outside the input root, or not what the recipe pinned."""


def resolve(input_root: Path, relative: str) -> Path:
    """``input_root/relative``, refusing absolute paths and anything escaping the root (also via symlinks)."""
    if Path(relative).is_absolute() or ".." in Path(relative).parts:
        raise InputError(f"input path {relative!r} must be relative to the input root without '..'")
    root = input_root.resolve()
    candidate = (root / relative).resolve()
    if candidate != root and root not in candidate.parents:
        raise InputError(
            f"input path {relative!r} resolves to {candidate}, outside the input root {root}"
        )
    return candidate


def location(item: dict) -> str:
    """Where an input lives under the input root: its ``path``, or its ``name`` if remote."""
    return item["path"] if "path" in item else item["name"]


def verify(recipe: dict, input_root: Path) -> list[dict]:
    """Hash every pinned input; returns ``[{name, path, sha256, size}]`` or raises InputError.

    Every input is checked before reporting, so one run names every bad file.
    """
    verified, problems = [], []
    for item in recipe.get("inputs", []):
        try:
            path = resolve(input_root, location(item))
        except InputError as exc:
            problems.append(f"input {item['name']!r}: {exc}")
            continue
        if not path.is_file():
            if "path" in item:
                problems.append(
                    f"input {item['name']!r}: {path} does not exist (pinned in the recipe as {item['path']!r})"
                )
            else:
                problems.append(
                    f"input {item['name']!r}: remote input {item['url']} not fetched: {path} does "
                    "not exist (run fetch_inputs / `minifield fetch-inputs` into this input root)"
                )
            continue
        if "size" in item and path.stat().st_size != item["size"]:
            problems.append(
                f"input {item['name']!r}: {path} has {path.stat().st_size} bytes, but the recipe "
                f"pins size {item['size']}"
            )
            continue
        actual = sha256_file(path)
        if actual != item["sha256"]:
            problems.append(
                f"input {item['name']!r}: {path} has sha256 {actual}, but the recipe pins {item['sha256']}"
            )
            continue
        verified.append(
            {
                "name": item["name"],
                "path": location(item),
                "sha256": actual,
                "size": path.stat().st_size,
            }
        )
    if problems:
        raise InputError("; ".join(problems))
    return verified


def files_by_name(recipe: dict, input_root: Path) -> dict[str, Path]:
    return {item["name"]: resolve(input_root, location(item)) for item in recipe.get("inputs", [])}
