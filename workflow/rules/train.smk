# Checkpoints and attempt directories live in the work dir, not in declared outputs:
# Snakemake deletes the outputs of a failed job, and a retry must resume from them.
rule train:
    input:
        recipe="results/computations/{cdigest}/recipe.json",
        inputs="results/computations/{cdigest}/inputs.json",
        examples=examples_manifest,
    output:
        result="results/computations/{cdigest}/train/result.json",
        export=directory("results/computations/{cdigest}/train/export"),
    params:
        input_root=INPUT_ROOT,
        work_dir=work_dir,
        record_state_hashes=config["train"]["record_state_hashes"],
        allow_environment_change=config["train"]["allow_environment_change"],
    resources:
        gpu=config["train"]["gpus"],
    retries: config["train"]["retries"]
    log:
        "logs/train/{cdigest}.log",
    benchmark:
        "results/benchmarks/train/{cdigest}.tsv"
    conda:
        "../../envs/minifield.yaml"
    script:
        "../scripts/train.py"
