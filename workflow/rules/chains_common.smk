# Chained computations (config "chains" and "two_stage", docs/two-stage.md) and reference
# products (docs/preference.md): the links table and the input functions of
# workflow/rules/chains.smk and reference.smk, kept apart from their rules.
from pathlib import Path

from minifield.pipeline import chains
from minifield.strategies import grpo

#: (kind key, upstream digest, digest of the recipe as written) -> link; configured links
#: when parsing, then the links the workflow makes (a reference for every DPO/IPO recipe)
LINKS = {}
#: short reference digest -> a link reading it (its recipe and input root compute it)
REFERENCES = {}


def add_link(link):
    LINKS[(link.kind.key, link.a, link.b)] = link
    if link.kind.key == "reference":
        REFERENCES.setdefault(link.a, link)
    return link


def follow_up(computation, made_by=None):
    """The reference link of a computation that needs one (None otherwise), added; not for
    one a reference link made (``made_by``), whose reference is pinned."""
    if made_by is not None and made_by.kind.key == "reference":
        return None
    link = chains.link_reference(computation, INPUT_ROOT)
    return None if link is None else add_link(link)


for _link in chains.load_links(config, COMPUTATIONS):
    add_link(_link)
# a configured recipe that needs a reference runs as the reference link completes it, not as
# written (its reference pin is a placeholder): found by digest, not a target itself
for _cdigest in [c for c in COMPUTATIONS if follow_up(COMPUTATIONS[c])]:
    COMPUTATIONS.registered[_cdigest] = COMPUTATIONS.pop(_cdigest)
#: the links the config alone makes (its chains and two-stage pairs, its recipes' references),
#: whose targets reach every other link (link_targets follows each to the links it makes): the
#: target functions start from these only, so a job's inputs are the same list whether or not
#: an earlier run made the links below (with those too, a rerun listed the followed links'
#: targets twice, and Snakemake saw the outcome page's inputs changed)
CONFIGURED_LINKS = list(LINKS.values())
# A downstream recipe already linked is registered when parsing too: a job started in its
# own Snakemake process (a cluster executor) finds its computation by digest.
for _link in list(LINKS.values()):
    while _link is not None and Path(_link.recipe_path).is_file():
        _link = follow_up(chains.register(COMPUTATIONS, _link), _link)


wildcard_constraints:
    a="[0-9a-f]{16}",
    b="[0-9a-f]{16}",
    s1="[0-9a-f]{16}",
    s2="[0-9a-f]{16}",


def link_inputs(kind):
    """Input function of a link checkpoint: the recipe as written, the upstream product
    and, for a computation's export, its recipe and evaluation (acceptance is checked).
    """

    def inputs(wildcards):
        link = LINKS[(kind.key, wildcards.a, wildcards.b)]
        found = {"written": str(link.written_path), "product": link.product}
        if kind.upstream_label is not None:
            base = f"results/computations/{link.a}"
            found.update(
                upstream_recipe=f"{base}/recipe.json",
                upstream_metrics=f"{base}/eval/metrics.json",
            )
        return found

    return inputs


def link_input_root(kind):
    def root(wildcards):
        return LINKS[(kind.key, wildcards.a, wildcards.b)].input_root or INPUT_ROOT

    return root


def linked_computation(kind_key, a, b):
    """The downstream computation the link wrote (Snakemake runs the link first if needed)."""
    link = LINKS[(kind_key, a, b)]
    getattr(checkpoints, link.kind.rule).get(a=a, b=b)
    return chains.register(COMPUTATIONS, link)


def link_targets(link):
    """A link's recipe and its downstream results; a computation that needs a reference,
    its reference link's instead."""
    computation = linked_computation(link.kind.key, link.a, link.b)
    extra = []
    if link.kind.key == "chains" and computation.recipe.strategy.name == "preference":
        extra = [f"{link.directory}/before-after.json"]
        extra.append(f"{link.directory}/report/before-after.html")
    if link.kind.key == "chains" and computation.recipe.strategy.name == "grpo":
        extra = [f"{link.directory}/rl-before-after.json"]
        extra.append(f"{link.directory}/report/rl-before-after.html")
    follow = follow_up(computation, link)
    if follow is not None:
        return [link.recipe_path, *extra, *link_targets(follow)]
    base = f"results/computations/{computation.cdigest}"
    targets = [
        link.recipe_path,
        f"{base}/eval/metrics.json",
        f"{base}/publication.json",
    ]
    targets += [f"{base}/capacity.json", f"{base}/summary.json"]
    targets += [f"{base}/report/{item}" for item in REPORT_ITEMS]
    targets += extra
    if link.kind.key == "two_stage":
        targets.append(f"{link.directory}/comparison.json")
        targets.append(f"{link.directory}/report/two-stage.html")
    if config["store"]["activate"]:
        targets.append(f"{base}/activation.json")
    return targets


def chain_targets():
    """Input functions of the final target `all` and the outcome page, one per configured
    link (``CONFIGURED_LINKS``), each with the links it makes; each waits for its own
    checkpoint (one function for all would stop at the first link not yet made)."""

    def targets_of(link):
        return lambda wildcards: link_targets(link)

    return [targets_of(link) for link in CONFIGURED_LINKS]


# Input functions of the two-stage comparison (two_stage.smk)
def stage2_file(name):
    """Input function: a file of the stage-2 computation the link wrote."""

    def path(wildcards):
        cdigest = linked_computation("two_stage", wildcards.s1, wildcards.s2).cdigest
        return f"results/computations/{cdigest}/{name}"

    return path


def baseline_metrics(wildcards):
    """The stage-2 recipe as written, from a random initialisation, when configured."""
    if wildcards.s2 in COMPUTATIONS:
        return f"results/computations/{wildcards.s2}/eval/metrics.json"
    return []


def stage1_publication(wildcards):
    if rules.has("publish"):
        return f"results/computations/{wildcards.s1}/publication.json"
    return []


# Input functions of the reference and before/after rules (reference.smk)
def reference_inputs(wildcards):
    """The recipe a reference is computed from and its pair and base files."""
    link = REFERENCES[wildcards.r]
    return {
        "recipe": str(link.written_path),
        "files": chains.reference_input_files(link),
    }


def before_after_inputs(wildcards):
    """A chain into a preference recipe: the upstream export (before), the preference
    computation's export (after, through its reference link when it has one), its recipe
    (the check's tolerance) and the pairs.
    """
    computation = linked_computation("chains", wildcards.a, wildcards.b)
    follow = follow_up(computation)
    final = computation
    if follow is not None:
        final = linked_computation("reference", follow.a, follow.b)
    paths = {i["name"]: i["path"] for i in computation.recipe.data["inputs"]}
    return {
        "before": f"results/computations/{wildcards.a}/train/export",
        "after": f"results/computations/{final.cdigest}/train/export",
        "recipe": f"results/computations/{final.cdigest}/recipe.json",
        "dev": f"{computation.own_root}/{paths['dev']}",
        "test": f"{computation.own_root}/{paths['test']}",
    }


def rl_before_after_inputs(wildcards):
    """A chain into a grpo recipe: the upstream export (before), the grpo computation's export
    (after), its recipe (the checks' tolerances), the prompts and the Python rewards' files.
    """
    computation = linked_computation("chains", wildcards.a, wildcards.b)
    paths = {i["name"]: i["path"] for i in computation.recipe.data["inputs"]}
    files = {
        name: f"{computation.own_root}/{paths[name]}"
        for name in ["dev", "test", *rl_reward_files(wildcards)]
    }
    return {
        "before": f"results/computations/{wildcards.a}/train/export",
        "after": f"results/computations/{computation.cdigest}/train/export",
        "recipe": f"results/computations/{computation.cdigest}/recipe.json",
        **files,
    }


def rl_reward_files(wildcards):
    """The pinned inputs of a chained grpo recipe that hold Python rewards."""
    computation = linked_computation("chains", wildcards.a, wildcards.b)
    return grpo.python_reward_inputs(computation.recipe.data)
