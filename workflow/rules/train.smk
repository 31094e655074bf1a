# Checkpoints and attempt directories live in the work dir, not in declared outputs:
# Snakemake deletes the outputs of a failed job, and a retry must resume from them.
# Training needs a passing recovery proof of the same computation (qualify.smk).
# Operational settings (supervision, GPU leases) are read from the config by the script, so
# changing them does not re-trigger a finished training.
rule train:
    input:
        recipe="results/computations/{cdigest}/recipe.json",
        inputs="results/computations/{cdigest}/inputs.json",
        examples=examples_manifest,
        quantized=quantized_base_manifest,
        fetched=fetched_input_root,
        proof="results/computations/{cdigest}/qualification/proof.json",
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
        **training_resources(),
    params:
        input_root=computation_input_root,
        work_dir=work_dir,
        lease_dir=LEASE_DIR,
    script:
        "../scripts/train.py"
