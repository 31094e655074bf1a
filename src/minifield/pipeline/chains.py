"""Chained computations: a recipe as written made concrete from an upstream product (another
computation's export, a reference), linked by digest in the workflow's DAG (config
``chains`` and ``two_stage``, docs/two-stage.md).

A downstream computation's digest covers the upstream product (its files are pinned
inputs), which exists only once the upstream computation has trained, so it is unknown when
the Snakefile is parsed. One mechanism serves every kind of link: a Snakemake
``checkpoint`` per kind whose output path is known at parse time,
``<kind directory>/{a}/{b}/`` with ``a`` the upstream digest (a computation's, or a reference
product's) and ``b`` the digest of the downstream recipe as written. It refuses an upstream
computation whose evaluation failed its acceptance, completes the recipe from the product (the kind's ``complete``: which
pinned inputs it adds or replaces) and gives it its own input root; after it ran, the
concrete computation is registered under its own digest (:func:`register`) and goes through
the usual rules (validate … evaluate, publish, report).

Kinds: ``two_stage`` (stage 2 starts from a stage-1 export: ``model.init.stage1``),
``chains`` (the export replaces the files ``model.base`` names) and ``reference`` (a
preference recipe's reference log-probabilities, a product addressed by its reference
digest, replace the file it pins; not configured: every DPO/IPO recipe of the workflow,
configured or linked, gets one, :func:`link_reference`).
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from .. import atomic
from .. import recipe as recipes
from ..digest import short
from ..inputs import linked_root
from ..inputs.linked_root import LinkError
from ..strategies import preference, two_stage
from ..strategies.lm import chain_base
from . import computations as comps
from . import reference_logprobs, stage_links


class LinkConfigError(comps.ConfigError):
    pass


@dataclass(frozen=True)
class Kind:
    #: the config key listing links of this kind and its entries' two keys (None: links of
    #: this kind are made by the workflow, not configured)
    key: str
    entry_keys: tuple[str, str] | None
    #: the checkpoint rule that links, its output directory and recipe file name
    rule: str
    directory: str
    recipe_file: str
    #: the upstream product's directory ({a}: the upstream digest) and where its files go
    #: under the downstream input root
    product: str
    product_subdir: str
    #: (recipe as written, product directory, upstream computation digest or None) ->
    #: the concrete recipe
    complete: Callable[[dict, Path, str | None], dict]
    #: (upstream recipe, recipe as written) -> a configuration problem, or None
    check: Callable[[recipes.Recipe, recipes.Recipe], str | None] | None
    #: how messages name the upstream computation; None: the product is not a computation's
    #: (no evaluation to pass)
    upstream_label: str | None


def _check_chain(upstream: recipes.Recipe, written: recipes.Recipe) -> str | None:
    if "base" not in written.data.get("model", {}):
        return "has no model.base for the upstream export to replace"
    return None


EXPORT = "results/computations/{a}/train/export"
KINDS = {
    kind.key: kind
    for kind in (
        Kind(
            key="two_stage",
            entry_keys=("stage1", "stage2"),
            rule="two_stage_link",
            directory="results/two-stage",
            recipe_file="stage2.json",
            product=EXPORT,
            product_subdir=two_stage.link.STAGE1_DIR,
            complete=two_stage.link.stage2_recipe,
            check=stage_links.check_stages,
            upstream_label="stage 1",
        ),
        Kind(
            key="chains",
            entry_keys=("from", "to"),
            rule="chain_link",
            directory="results/chains",
            recipe_file="recipe.json",
            product=EXPORT,
            product_subdir=chain_base.PRODUCT_DIR,
            complete=lambda written, product, _: chain_base.base_recipe(written, product),
            check=_check_chain,
            upstream_label="the upstream computation",
        ),
        Kind(
            key="reference",
            entry_keys=None,
            rule="reference_link",
            directory="results/preference",
            recipe_file="recipe.json",
            product="results/reference/{a}",
            product_subdir=preference.reference_link.PRODUCT_DIR,
            complete=lambda written, product, _: preference.reference_link.reference_recipe(
                written, product
            ),
            check=None,
            upstream_label=None,
        ),
    )
}


@dataclass(frozen=True)
class Link:
    kind: Kind
    #: the upstream digest (a computation's, or a reference product's)
    a: str
    written_path: Path
    #: the downstream recipe as written
    written: recipes.Recipe
    #: where the written recipe's inputs are (None: the configured input root)
    input_root: str | None = None

    @property
    def b(self) -> str:
        return short(self.written.computation_digest)

    @property
    def directory(self) -> str:
        return f"{self.kind.directory}/{self.a}/{self.b}"

    @property
    def recipe_path(self) -> str:
        return f"{self.directory}/{self.kind.recipe_file}"

    @property
    def product(self) -> str:
        return self.kind.product.format(a=self.a)


def load_links(config: dict, computations: dict) -> list[Link]:
    """Every configured link, checked: the upstream recipe is one of the config's recipes,
    the downstream one valid and fit for the kind."""
    found, problems = [], []
    by_path = {str(Path(c.path)): c for c in computations.values()}
    for kind in KINDS.values():
        if kind.entry_keys is None:
            continue
        up_key, down_key = kind.entry_keys
        for index, entry in enumerate(config.get(kind.key) or []):
            where = f"config {kind.key}[{index}]"
            upstream = by_path.get(str(Path(entry[up_key])))
            if upstream is None:
                problems.append(f"{where}.{up_key}: {entry[up_key]} is not one of recipes")
                continue
            try:
                written = reference_logprobs.validated(Path(entry[down_key]))
            except recipes.RecipeError as exc:
                problems.append(f"{where}.{down_key}: {exc}")
                continue
            problem = kind.check(upstream.recipe, written)
            if problem is not None:
                problems.append(f"{where}: {problem}")
                continue
            found.append(Link(kind, upstream.cdigest, Path(entry[down_key]), written))
    if problems:
        raise LinkConfigError("invalid links in the config:\n" + "\n".join(problems))
    return found


def link_reference(computation: comps.Computation, input_root: str) -> Link | None:
    """The link giving ``computation`` (a DPO/IPO preference recipe, as configured or as
    another link wrote it) its reference product; None for any other recipe. Its inputs
    are read under ``input_root`` (the computation's own root, when it has one)."""
    if not preference.reference_link.needs_reference(computation.recipe.data):
        return None
    root = comps.input_root(computation, input_root)
    digest = short(preference.reference.reference_digest(computation.recipe, root))
    return Link(KINDS["reference"], digest, Path(computation.path), computation.recipe, root)


def register(computations: comps.Computations, link: Link) -> comps.Computation:
    """The concrete downstream computation the link wrote, registered by its digest."""
    path = Path(link.recipe_path)
    computation = comps.Computation(
        path, reference_logprobs.validated(path), own_root=f"{link.directory}/inputs"
    )
    return computations.register(computation)


def link(
    kind_key: str,
    written_path: Path,
    product_dir: Path,
    input_root: Path,
    out_recipe: Path,
    out_root: Path,
    upstream_recipe: Path | None = None,
    upstream_metrics: Path | None = None,
) -> dict:
    """The link stage: the concrete downstream recipe and its input root.

    Refuses (a failed rule, nothing downstream to train on) an upstream computation whose
    evaluation did not pass its acceptance, and a product the kind cannot start from."""
    kind = KINDS[kind_key]
    upstream_digest = None
    if kind.upstream_label is not None:
        upstream_digest = recipes.load(upstream_recipe).computation_digest
        metrics = atomic.read_json(upstream_metrics)
        if metrics.get("computation_digest") != upstream_digest:
            raise LinkError(
                f"{upstream_metrics}: evaluation of computation "
                f"{metrics.get('computation_digest')}, not of {kind.upstream_label} "
                f"({upstream_digest})"
            )
        if not metrics.get("acceptance", {}).get("passed", False):
            raise LinkError(
                f"{upstream_metrics}: {kind.upstream_label} did not pass its acceptance evaluation"
            )
    written = recipes.read_document(written_path)
    concrete = kind.complete(written, product_dir, upstream_digest)
    # a preference recipe's reference may still be unpinned (its own link pins it)
    recipe = recipes.validate(preference.reference.pending(concrete), str(out_recipe))
    if out_root.exists():
        shutil.rmtree(out_root)
    # the inputs as written (validation may add a placeholder for an unpinned reference)
    linked_root.make(concrete, input_root, product_dir, kind.product_subdir, out_root)
    atomic.write_json(out_recipe, concrete)
    return {"computation_digest": recipe.computation_digest}


def reference_input_files(link: Link) -> list[str]:
    """The files a reference link's product is computed from: every input of the recipe as
    written but the reference itself, under the link's input root."""
    named = link.written.data["preference"]["reference"]
    return [
        str(Path(link.input_root) / item["path"])
        for item in link.written.data["inputs"]
        if item["name"] != named and "path" in item
    ]
