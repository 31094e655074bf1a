# evaluate.processes is read from the config by the script (operational: the figures are
# the same over any number of processes, so changing it does not re-trigger an evaluation).
rule evaluate:
    input:
        recipe="results/computations/{cdigest}/recipe.json",
        result="results/computations/{cdigest}/train/result.json",
        examples=examples_manifest,
        # the verified inputs (a recipe's evaluation.harness task files are read from them)
        inputs="results/computations/{cdigest}/inputs.json",
        quantized=quantized_base_manifest,
    output:
        metrics="results/computations/{cdigest}/eval/metrics.json",
        selected_export=directory("results/computations/{cdigest}/eval/selected-export"),
    log:
        "logs/evaluate/{cdigest}.log",
    benchmark:
        "results/benchmarks/evaluate/{cdigest}.tsv"
    conda:
        "../../envs/minifield.yaml"
    resources:
        **evaluation_resources(),
    params:
        input_root=computation_input_root,
        work_dir=work_dir,
    script:
        "../scripts/evaluate.py"
