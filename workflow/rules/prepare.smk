rule prepare:
    input:
        recipe=examples_recipe,
        inputs=examples_inputs_record,
    output:
        "results/examples/{edigest}/manifest.json",
    log:
        "logs/prepare/{edigest}.log",
    benchmark:
        "results/benchmarks/prepare/{edigest}.tsv"
    params:
        input_root=INPUT_ROOT,
    script:
        "../scripts/prepare.py"
