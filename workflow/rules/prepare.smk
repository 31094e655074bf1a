rule prepare:
    input:
        recipe=examples_recipe,
        inputs=examples_inputs_record,
    output:
        "results/examples/{edigest}/manifest.json",
    params:
        input_root=INPUT_ROOT,
    log:
        "logs/prepare/{edigest}.log",
    benchmark:
        "results/benchmarks/prepare/{edigest}.tsv"
    conda:
        "../../envs/minifield.yaml"
    script:
        "../scripts/prepare.py"
