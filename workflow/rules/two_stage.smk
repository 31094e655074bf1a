# Two-stage computations (config "two_stage", docs/two-stage.md): stage 2 starts from stage
# 1's export through the chains' link (workflow/rules/chains.smk, checkpoint
# two_stage_link); this rule compares the stages and the random-initialisation baseline
# (its input functions are in chains_common.smk).


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
