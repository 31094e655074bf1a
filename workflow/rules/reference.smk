# Reference log-probabilities as a pipeline product (docs/preference.md "The pipeline"): one
# directory per reference digest (reference model pins, prepared pairs, template), computed
# once for every recipe that shares it (a sweep over beta) and pinned by the recipes through
# the reference link (workflow/rules/chains.smk). Input functions: chains_common.smk.


wildcard_constraints:
    r="[0-9a-f]{16}",


rule reference:
    input:
        unpack(reference_inputs),
    output:
        directory("results/reference/{r}"),
    log:
        "logs/reference/{r}.log",
    conda:
        "../../envs/minifield.yaml"
    params:
        input_root=lambda wildcards: REFERENCES[wildcards.r].input_root,
    script:
        "../scripts/reference.py"


rule before_after:
    input:
        unpack(before_after_inputs),
    output:
        record="results/chains/{a}/{b}/before-after.json",
        table=report(
            "results/chains/{a}/{b}/report/before-after.html",
            caption="../report/before-after.rst",
            category="8. Preference",
            labels={"upstream": "{a}", "preference recipe as written": "{b}"},
        ),
    log:
        "logs/before_after/{a}-{b}.log",
    conda:
        "../../envs/minifield.yaml"
    script:
        "../scripts/before_after.py"
