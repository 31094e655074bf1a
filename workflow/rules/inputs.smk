rule hash_inputs:
    input:
        recipe="results/computations/{cdigest}/recipe.json",
        pinned=pinned_input_files,
    output:
        "results/computations/{cdigest}/inputs.json",
    log:
        "logs/hash_inputs/{cdigest}.log",
    params:
        input_root=INPUT_ROOT,
    script:
        "../scripts/hash_inputs.py"
