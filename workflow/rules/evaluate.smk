rule evaluate:
    input:
        recipe="results/computations/{cdigest}/recipe.json",
        result="results/computations/{cdigest}/train/result.json",
        examples=examples_manifest,
    output:
        "results/computations/{cdigest}/eval/metrics.json",
    log:
        "logs/evaluate/{cdigest}.log",
    benchmark:
        "results/benchmarks/evaluate/{cdigest}.tsv"
    conda:
        "../../envs/minifield.yaml"
    script:
        "../scripts/evaluate.py"
