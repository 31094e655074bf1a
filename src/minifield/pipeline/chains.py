"""Chained computations: a recipe as written made concrete from an upstream computation's
export, linked by digest in the workflow's DAG (config ``chains`` and ``two_stage``,
docs/two-stage.md).

A downstream computation's digest covers the upstream product (its files are pinned
inputs), which exists only once the upstream computation has trained, so it is unknown when
the Snakefile is parsed. One mechanism serves every kind of link: a Snakemake
``checkpoint`` per kind whose output path is known at parse time,
``<kind directory>/{a}/{b}/`` with ``a`` the upstream computation digest and ``b`` the digest
of the downstream recipe as written. It refuses an upstream computation whose evaluation
failed its acceptance, completes the recipe from the product (the kind's ``complete``: which
pinned inputs it adds or replaces) and gives it its own input root; after it ran, the
concrete computation is registered under its own digest (:func:`register`) and goes through
the usual rules (validate … evaluate, publish, report).

Kinds: ``two_stage`` (stage 2 starts from a stage-1 export: ``model.init.stage1``) and
``chains`` (the export replaces the files ``model.base`` names).
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
from ..strategies.packed_sft import chain_base
from ..strategies.two_stage import link as two_stage_link
from . import computations as comps
from . import stage_links


class LinkConfigError(comps.ConfigError):
    pass


@dataclass(frozen=True)
class Kind:
    #: the config key listing links of this kind, and its entries' two keys
    key: str
    upstream_key: str
    downstream_key: str
    #: the checkpoint rule that links them, its output directory and recipe file name
    rule: str
    directory: str
    recipe_file: str
    #: where the product's files go under the downstream input root
    product_subdir: str
    #: (recipe as written, product directory, upstream computation digest) -> concrete recipe
    complete: Callable[[dict, Path, str], dict]
    #: (upstream recipe, recipe as written) -> a configuration problem, or None
    check: Callable[[recipes.Recipe, recipes.Recipe], str | None]
    #: how messages name the upstream computation
    upstream_label: str


def _check_chain(upstream: recipes.Recipe, written: recipes.Recipe) -> str | None:
    if "base" not in written.data.get("model", {}):
        return "has no model.base for the upstream export to replace"
    return None


KINDS = {
    kind.key: kind
    for kind in (
        Kind(
            key="two_stage",
            upstream_key="stage1",
            downstream_key="stage2",
            rule="two_stage_link",
            directory="results/two-stage",
            recipe_file="stage2.json",
            product_subdir=two_stage_link.STAGE1_DIR,
            complete=two_stage_link.stage2_recipe,
            check=stage_links.check_stages,
            upstream_label="stage 1",
        ),
        Kind(
            key="chains",
            upstream_key="from",
            downstream_key="to",
            rule="chain_link",
            directory="results/chains",
            recipe_file="recipe.json",
            product_subdir=chain_base.PRODUCT_DIR,
            complete=lambda written, export_dir, _digest: chain_base.base_recipe(
                written, export_dir
            ),
            check=_check_chain,
            upstream_label="the upstream computation",
        ),
    )
}


@dataclass(frozen=True)
class Link:
    kind: Kind
    upstream: comps.Computation
    written_path: Path
    #: the downstream recipe as written (configured in ``recipes`` too, it runs as written)
    written: recipes.Recipe

    @property
    def a(self) -> str:
        return self.upstream.cdigest

    @property
    def b(self) -> str:
        return short(self.written.computation_digest)

    @property
    def directory(self) -> str:
        return f"{self.kind.directory}/{self.a}/{self.b}"

    @property
    def recipe_path(self) -> str:
        return f"{self.directory}/{self.kind.recipe_file}"


def load_links(config: dict, computations: dict) -> list[Link]:
    """Every configured link of every kind, checked: the upstream recipe is one of the
    config's recipes, the downstream one valid and fit for the kind."""
    found, problems = [], []
    by_path = {str(Path(c.path)): c for c in computations.values()}
    for kind in KINDS.values():
        for index, entry in enumerate(config.get(kind.key) or []):
            where = f"config {kind.key}[{index}]"
            up_path, down_path = entry[kind.upstream_key], entry[kind.downstream_key]
            upstream = by_path.get(str(Path(up_path)))
            if upstream is None:
                problems.append(f"{where}.{kind.upstream_key}: {up_path} is not one of recipes")
                continue
            try:
                written = recipes.load(down_path)
            except recipes.RecipeError as exc:
                problems.append(f"{where}.{kind.downstream_key}: {exc}")
                continue
            problem = kind.check(upstream.recipe, written)
            if problem is not None:
                problems.append(f"{where}: {problem}")
                continue
            found.append(Link(kind, upstream, Path(down_path), written))
    if problems:
        raise LinkConfigError("invalid links in the config:\n" + "\n".join(problems))
    return found


def register(computations: comps.Computations, link: Link) -> comps.Computation:
    """The concrete downstream computation the link wrote, registered by its digest."""
    path = Path(link.recipe_path)
    computation = comps.Computation(path, recipes.load(path), own_root=f"{link.directory}/inputs")
    return computations.register(computation)


def link(
    kind_key: str,
    written_path: Path,
    upstream_recipe: Path,
    upstream_metrics: Path,
    product_dir: Path,
    input_root: Path,
    out_recipe: Path,
    out_root: Path,
) -> dict:
    """The link stage: the concrete downstream recipe and its input root.

    Refuses (a failed rule, nothing downstream to train on) an upstream computation whose
    evaluation did not pass its acceptance, and a product the kind cannot start from."""
    kind = KINDS[kind_key]
    upstream = recipes.load(upstream_recipe)
    metrics = atomic.read_json(upstream_metrics)
    if metrics.get("computation_digest") != upstream.computation_digest:
        raise LinkError(
            f"{upstream_metrics}: evaluation of computation {metrics.get('computation_digest')}, "
            f"not of {kind.upstream_label} ({upstream.computation_digest})"
        )
    if not metrics.get("acceptance", {}).get("passed", False):
        raise LinkError(
            f"{upstream_metrics}: {kind.upstream_label} did not pass its acceptance evaluation"
        )
    written = recipes.read_document(written_path)
    concrete = kind.complete(written, product_dir, upstream.computation_digest)
    recipe = recipes.validate(concrete, str(out_recipe))
    if out_root.exists():
        shutil.rmtree(out_root)
    linked_root.make(recipe.data, input_root, product_dir, kind.product_subdir, out_root)
    atomic.write_json(out_recipe, concrete)
    return {"computation_digest": recipe.computation_digest}
