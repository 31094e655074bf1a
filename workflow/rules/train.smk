# Checkpoints and attempt directories live in the work dir, not in declared outputs:
# Snakemake deletes the outputs of a failed job, and a retry must resume from them.
rule train:
    input:
        recipe="results/computations/{cdigest}/recipe.json",
        inputs="results/computations/{cdigest}/inputs.json",
        examples=examples_manifest,
        fetched=fetched_input_root,
    output:
        result="results/computations/{cdigest}/train/result.json",
        export=directory("results/computations/{cdigest}/train/export"),
    log:
        "logs/train/{cdigest}.log",
    benchmark:
        "results/benchmarks/train/{cdigest}.tsv"
    retries: config["train"]["retries"]
    conda:
        "../../envs/minifield.yaml"
    resources:
        gpu=config["train"]["gpus"],
    params:
        input_root=computation_input_root,
        work_dir=work_dir,
        record_state_hashes=config["train"]["record_state_hashes"],
        allow_environment_change=config["train"]["allow_environment_change"],
    script:
        "../scripts/train.py"
