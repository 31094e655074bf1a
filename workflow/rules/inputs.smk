rule hash_inputs:
    input:
        recipe="results/computations/{cdigest}/recipe.json",
        pinned=pinned_input_files,
    output:
        "results/computations/{cdigest}/inputs.json",
    log:
        "logs/hash_inputs/{cdigest}.log",
    conda:
        "../../envs/minifield.yaml"
    params:
        input_root=computation_input_root,
    script:
        "../scripts/hash_inputs.py"
