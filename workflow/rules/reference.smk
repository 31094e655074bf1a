# Reference log-probabilities as a pipeline product (docs/preference.md "The pipeline"): one
# directory per reference digest (reference model pins, prepared pairs, template), computed
# once for every recipe that shares it (a sweep over beta) and pinned by the recipes through
# the reference link (workflow/rules/chains.smk).


wildcard_constraints:
    r="[0-9a-f]{16}",


def reference_inputs(wildcards):
    """The recipe a reference is computed from and its pair and base files."""
    link = REFERENCES[wildcards.r]
    return {
        "recipe": str(link.written_path),
        "files": chains.reference_input_files(link),
    }


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
