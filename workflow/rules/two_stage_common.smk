# Two-stage helpers (config "two_stage", docs/two-stage.md): the links table and the input
# functions of workflow/rules/two_stage.smk, kept apart from its rules.
from pathlib import Path

from minifield.pipeline import stage_links

TWO_STAGE_LINKS = {
    (link.s1, link.s2): link for link in stage_links.load_links(config, COMPUTATIONS)
}

# A stage-2 recipe already linked is registered when parsing too: a job started in its own
# Snakemake process (a cluster executor) finds its computation by digest.
for _link in TWO_STAGE_LINKS.values():
    if Path(_link.directory, "stage2.json").is_file():
        stage_links.register_stage2(COMPUTATIONS, _link.directory)


wildcard_constraints:
    s1="[0-9a-f]{16}",
    s2="[0-9a-f]{16}",


def two_stage_link_of(wildcards):
    return TWO_STAGE_LINKS[(wildcards.s1, wildcards.s2)]


def linked_stage2(wildcards):
    """The stage-2 computation the link wrote (Snakemake runs the link first if needed)."""
    directory = checkpoints.two_stage_link.get(
        s1=wildcards.s1, s2=wildcards.s2
    ).output.root
    return stage_links.register_stage2(COMPUTATIONS, str(Path(directory).parent))


def stage2_file(name):
    def path(wildcards):
        return f"results/computations/{linked_stage2(wildcards).cdigest}/{name}"

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


def two_stage_targets(wildcards):
    """Every two-stage link's stage-2 results and comparison (rule all)."""
    targets = []
    for link in TWO_STAGE_LINKS.values():
        out = checkpoints.two_stage_link.get(s1=link.s1, s2=link.s2).output
        cdigest = stage_links.register_stage2(COMPUTATIONS, link.directory).cdigest
        base = f"results/computations/{cdigest}"
        targets += [out.recipe, f"{link.directory}/comparison.json"]
        targets += [f"{base}/eval/metrics.json", f"{base}/publication.json"]
        targets += [f"{base}/capacity.json", f"{base}/summary.json"]
        targets += [f"{base}/report/{item}" for item in REPORT_ITEMS]
        targets += [f"{link.directory}/report/two-stage.html"]
        if config["store"]["activate"]:
            targets.append(f"{base}/activation.json")
    return targets
