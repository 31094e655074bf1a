# Remote (url) inputs: downloaded into the content-addressed cache, verified while streaming,
# and placed, together with the recipe's local inputs, in the computation's own input root.
# Fetch settings (origins, credentials, cache) are read from config["remote_inputs"] inside
# the script, not passed as params: they decide how bytes arrive, not which bytes, so
# changing them must not re-run training. A local rule: compute nodes often have no network.
localrules:
    fetch_inputs,


rule fetch_inputs:
    input:
        recipe="results/computations/{cdigest}/recipe.json",
        local=local_input_files,
    output:
        root=directory("results/fetched/{cdigest}"),
        record="results/computations/{cdigest}/fetched.json",
    log:
        "logs/fetch_inputs/{cdigest}.log",
    benchmark:
        "results/benchmarks/fetch_inputs/{cdigest}.tsv"
    conda:
        "../../envs/minifield.yaml"
    params:
        input_root=INPUT_ROOT,
        work_dir=WORK_DIR,
    script:
        "../scripts/fetch_inputs.py"
