rule hash_inputs:
    input:
        recipe="results/computations/{cdigest}/recipe.json",
        pinned=pinned_input_files,
    output:
        "results/computations/{cdigest}/inputs.json",
    params:
        input_root=INPUT_ROOT,
    log:
        "logs/hash_inputs/{cdigest}.log",
    conda:
        "../../envs/minifield.yaml"
    script:
        "../scripts/hash_inputs.py"
