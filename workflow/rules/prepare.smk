rule prepare:
    input:
        recipe=examples_recipe,
        inputs=examples_inputs_record,
        fetched=examples_fetched_root,
    output:
        "results/examples/{edigest}/manifest.json",
    log:
        "logs/prepare/{edigest}.log",
    benchmark:
        "results/benchmarks/prepare/{edigest}.tsv"
    conda:
        "../../envs/minifield.yaml"
    params:
        input_root=examples_input_root,
    script:
        "../scripts/prepare.py"
