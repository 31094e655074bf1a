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


def before_after_inputs(wildcards):
    """A chain into a preference recipe: the upstream export (before), the preference
    computation's export (after, through its reference link when it has one) and the pairs.
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
        "dev": f"{computation.own_root}/{paths['dev']}",
        "test": f"{computation.own_root}/{paths['test']}",
    }


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
