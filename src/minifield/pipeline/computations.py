"""The workflow's view of the configuration: which computations exist and where their files go.

Everything here runs at Snakemake parse time, so it only reads small files
(config, recipes); large inputs are hashed inside the ``hash_inputs`` rule.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from .. import recipe as recipes
from ..digest import short
from . import reference_logprobs


class ConfigError(Exception):
    pass


@dataclass(frozen=True)
class Computation:
    path: Path  # the recipe file
    recipe: recipes.Recipe
    #: an input root another rule makes for this computation (a two-stage computation's
    #: stage 2: its data and the stage-1 export), or None
    own_root: str | None = None

    @property
    def cdigest(self) -> str:
        return short(self.recipe.computation_digest)

    @property
    def edigest(self) -> str:
        return short(self.recipe.examples_digest)

    @property
    def qdigest(self) -> str | None:
        """Short digest of the quantized base it trains on (None: its base is not quantized)."""
        found = self.recipe.quantized_base_digest
        return None if found is None else short(found)

    @property
    def sdigests(self) -> dict[str, str]:
        """Training input name → short digest of that source prepared on its own."""
        return {name: short(d) for name, d in self.recipe.source_digests.items()}


class Computations(dict):
    """Short computation digest → computation: the configured recipes, iterated for the
    workflow's targets, plus computations registered once their recipe exists (a two-stage
    computation's stage 2, whose digest covers stage 1's export): found by digest, never
    iterated, so the configured targets stay what parsing the config gave."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.registered: dict[str, Computation] = {}

    def __missing__(self, cdigest: str) -> Computation:
        return self.registered[cdigest]

    def register(self, computation: Computation) -> Computation:
        return self.registered.setdefault(computation.cdigest, computation)

    def every(self) -> list[Computation]:
        return [*self.values(), *self.registered.values()]


def load_computations(config: dict) -> Computations:
    """Validate every configured recipe; map short computation digest → computation.

    All recipes are validated before anything fails, so one run names every bad
    recipe. Two recipe files with the same digest are the same computation.
    """
    found = Computations()
    problems = []
    for entry in config["recipes"]:
        path = Path(entry)
        try:
            # a preference recipe's reference may be unpinned: the pipeline computes it
            computation = Computation(path, reference_logprobs.validated(path))
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
    """``[fetched_root]`` for a computation with url inputs, its own root for one that has
    one, ``[]`` otherwise (rule inputs)."""
    if computation.own_root is not None:
        return [computation.own_root]
    return [fetched_root(computation)] if has_remote_inputs(computation) else []


def input_root(computation: Computation, configured_root: str) -> str:
    """Where the stages and the worker find this computation's inputs.

    A recipe with remote inputs gets its own root (remote inputs under their name,
    local ones linked at their path): the worker resolves every input under one root. So
    does a computation with its own root.
    """
    if computation.own_root is not None:
        return computation.own_root
    return fetched_root(computation) if has_remote_inputs(computation) else configured_root


def _every(computations: dict[str, Computation]) -> list[Computation]:
    if isinstance(computations, Computations):
        return computations.every()
    return list(computations.values())


def for_examples(computations: dict[str, Computation], edigest: str) -> Computation:
    """A computation whose data settings produce the examples ``edigest`` (any one will do)."""
    for computation in _every(computations):
        if computation.edigest == edigest:
            return computation
    raise ConfigError(f"no configured recipe has examples digest {edigest}")


def for_quantized_base(computations: dict[str, Computation], qdigest: str) -> Computation:
    """A computation that trains on the quantized base ``qdigest`` (any one will do: the base
    its examples hold is the same pinned base)."""
    for computation in _every(computations):
        if computation.qdigest == qdigest:
            return computation
    raise ConfigError(f"no configured recipe has quantized base digest {qdigest}")


def for_source(computations: dict[str, Computation], sdigest: str) -> tuple[Computation, str]:
    """A computation with the training source ``sdigest``, and that source's input name in it
    (the first in configuration order: the same source prepares the same rows in any)."""
    for computation in _every(computations):
        for name, digest in computation.sdigests.items():
            if digest == sdigest:
                return computation, name
    raise ConfigError(f"no configured recipe has a training source with digest {sdigest}")
