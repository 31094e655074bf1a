rule evaluate:
    input:
        recipe="results/computations/{cdigest}/recipe.json",
        result="results/computations/{cdigest}/train/result.json",
        examples=examples_manifest,
    output:
        metrics="results/computations/{cdigest}/eval/metrics.json",
        selected_export=directory("results/computations/{cdigest}/eval/selected-export"),
    log:
        "logs/evaluate/{cdigest}.log",
    benchmark:
        "results/benchmarks/evaluate/{cdigest}.tsv"
    conda:
        "../../envs/minifield.yaml"
    script:
        "../scripts/evaluate.py"
