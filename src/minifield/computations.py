"""The workflow's view of the configuration: which computations exist and where their files go.

Everything here runs at Snakemake parse time, so it only reads small files
(config, recipes); large inputs are hashed inside the ``hash_inputs`` rule.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from . import recipe as recipes
from .digest import short


class ConfigError(Exception):
    pass


@dataclass(frozen=True)
class Computation:
    path: Path  # the recipe file
    recipe: recipes.Recipe

    @property
    def cdigest(self) -> str:
        return short(self.recipe.computation_digest)

    @property
    def edigest(self) -> str:
        return short(self.recipe.examples_digest)


def load_computations(config: dict) -> dict[str, Computation]:
    """Validate every configured recipe; map short computation digest → computation.

    All recipes are validated before anything fails, so one run names every bad
    recipe. Two recipe files with the same digest are the same computation.
    """
    found: dict[str, Computation] = {}
    problems = []
    for entry in config["recipes"]:
        path = Path(entry)
        try:
            computation = Computation(path, recipes.load(path))
        except recipes.RecipeError as exc:
            problems.append(str(exc))
            continue
        found.setdefault(computation.cdigest, computation)
    if problems:
        raise ConfigError("invalid recipe(s) in config 'recipes':\n" + "\n".join(problems))
    return found


def input_paths(computation: Computation, input_root: str) -> list[str]:
    """Local pinned input files of a computation (relative to the working directory)."""
    return [
        str(Path(input_root) / item["path"])
        for item in computation.recipe.data["inputs"]
        if "path" in item
    ]


def has_remote_inputs(computation: Computation) -> bool:
    return any("url" in item for item in computation.recipe.data["inputs"])


def fetched_root(computation: Computation) -> str:
    """The computation's own input root, built by ``fetch_inputs`` for recipes with url inputs."""
    return f"results/fetched/{computation.cdigest}"


def fetched_roots(computation: Computation) -> list[str]:
    """``[fetched_root]`` for a computation with url inputs, ``[]`` otherwise (rule inputs)."""
    return [fetched_root(computation)] if has_remote_inputs(computation) else []


def input_root(computation: Computation, configured_root: str) -> str:
    """Where the stages and the worker find this computation's inputs.

    A recipe with remote inputs gets its own root (remote inputs under their name,
    local ones linked at their path): the worker resolves every input under one root.
    """
    return fetched_root(computation) if has_remote_inputs(computation) else configured_root


def for_examples(computations: dict[str, Computation], edigest: str) -> Computation:
    """A computation whose data settings produce the examples ``edigest`` (any one will do)."""
    for computation in computations.values():
        if computation.edigest == edigest:
            return computation
    raise ConfigError(f"no configured recipe has examples digest {edigest}")
