# Two-stage computations (config "two_stage", docs/two-stage.md): stage 2 starts from stage
# 1's export, so its computation digest is known only once stage 1 has trained. The link is
# a checkpoint whose output path is known when parsing (stage-1 digest / digest of the
# stage-2 recipe as written); after it ran, the concrete stage-2 recipe is registered under
# its own digest and goes through the usual rules (validate ... evaluate, publish).
from pathlib import Path

from minifield import stage_links

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


checkpoint two_stage_link:
    input:
        stage2=lambda wildcards: str(two_stage_link_of(wildcards).stage2_path),
        stage1_recipe="results/computations/{s1}/recipe.json",
        stage1_metrics="results/computations/{s1}/eval/metrics.json",
        export="results/computations/{s1}/train/export",
    output:
        recipe="results/two-stage/{s1}/{s2}/stage2.json",
        root=directory("results/two-stage/{s1}/{s2}/inputs"),
    log:
        "logs/two_stage_link/{s1}-{s2}.log",
    conda:
        "../../envs/minifield.yaml"
    params:
        input_root=INPUT_ROOT,
    script:
        "../scripts/two_stage_link.py"


rule two_stage_report:
    input:
        stage1_metrics="results/computations/{s1}/eval/metrics.json",
        stage1_publication=stage1_publication,
        stage2_recipe="results/two-stage/{s1}/{s2}/stage2.json",
        stage2_metrics=stage2_file("eval/metrics.json"),
        stage2_publication=stage2_file("publication.json"),
        baseline_metrics=baseline_metrics,
    output:
        comparison="results/two-stage/{s1}/{s2}/comparison.json",
        table=report(
            "results/two-stage/{s1}/{s2}/report/two-stage.html",
            caption="../report/two-stage.rst",
            category="7. Two stages",
            labels={"stage 1": "{s1}", "stage 2 as written": "{s2}"},
        ),
    log:
        "logs/two_stage_report/{s1}-{s2}.log",
    conda:
        "../../envs/minifield.yaml"
    script:
        "../scripts/two_stage_report.py"


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
