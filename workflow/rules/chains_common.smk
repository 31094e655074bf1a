# Chained computations (config "chains" and "two_stage", docs/two-stage.md): the links table
# and the input functions of workflow/rules/chains.smk, kept apart from its rules.
from pathlib import Path

from minifield.pipeline import chains

#: (config key of the kind, upstream digest, digest of the recipe as written) -> link
LINKS = {
    (link.kind.key, link.a, link.b): link
    for link in chains.load_links(config, COMPUTATIONS)
}

# A downstream recipe already linked is registered when parsing too: a job started in its
# own Snakemake process (a cluster executor) finds its computation by digest.
for _link in LINKS.values():
    if Path(_link.recipe_path).is_file():
        chains.register(COMPUTATIONS, _link)


wildcard_constraints:
    a="[0-9a-f]{16}",
    b="[0-9a-f]{16}",
    s1="[0-9a-f]{16}",
    s2="[0-9a-f]{16}",


def written_recipe(kind):
    """Input function: the downstream recipe as written of a link of this kind."""

    def path(wildcards):
        return str(LINKS[(kind.key, wildcards.a, wildcards.b)].written_path)

    return path


def linked_computation(kind_key, a, b):
    """The downstream computation the link wrote (Snakemake runs the link first if needed)."""
    link = LINKS[(kind_key, a, b)]
    getattr(checkpoints, link.kind.rule).get(a=a, b=b)
    return chains.register(COMPUTATIONS, link)


def chain_targets(wildcards):
    """Every link's downstream results, and a two-stage link's comparison (rule all)."""
    targets = []
    for link in LINKS.values():
        cdigest = linked_computation(link.kind.key, link.a, link.b).cdigest
        base = f"results/computations/{cdigest}"
        targets += [
            link.recipe_path,
            f"{base}/eval/metrics.json",
            f"{base}/publication.json",
        ]
        targets += [f"{base}/capacity.json", f"{base}/summary.json"]
        targets += [f"{base}/report/{item}" for item in REPORT_ITEMS]
        if link.kind.key == "two_stage":
            targets.append(f"{link.directory}/comparison.json")
            targets.append(f"{link.directory}/report/two-stage.html")
        if config["store"]["activate"]:
            targets.append(f"{base}/activation.json")
    return targets
