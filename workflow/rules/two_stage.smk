# Two-stage computations (config "two_stage", docs/two-stage.md): stage 2 starts from stage
# 1's export, so its computation digest is known only once stage 1 has trained. The link is
# a checkpoint whose output path is known when parsing (stage-1 digest / digest of the
# stage-2 recipe as written); after it ran, the concrete stage-2 recipe is registered under
# its own digest and goes through the usual rules (validate ... evaluate, publish).
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
