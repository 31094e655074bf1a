# Recovery proof: reference, crash after update k, resume, compare complete-state hashes.
# Its runs and a copy of the proof stay in the work dir: a failed proof's output is deleted.
rule qualify:
    input:
        recipe="results/computations/{cdigest}/recipe.json",
        inputs="results/computations/{cdigest}/inputs.json",
        examples=examples_manifest,
        quantized=quantized_base_manifest,
        fetched=fetched_input_root,
    output:
        "results/computations/{cdigest}/qualification/proof.json",
    log:
        "logs/qualify/{cdigest}.log",
    benchmark:
        "results/benchmarks/qualify/{cdigest}.tsv"
    conda:
        "../../envs/minifield.yaml"
    resources:
        **training_resources(),
    params:
        input_root=computation_input_root,
        work_dir=work_dir,
        lease_dir=LEASE_DIR,
        qualification=config["qualification"],
    script:
        "../scripts/qualify.py"
