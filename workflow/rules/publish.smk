# Publication: put the trained export into the content-addressed store (never activating it),
# and, only when config store.activate is true, activate it through the store's full gate.
# The store directory is shared mutable state, not a declared output: after deleting it,
# rerun with --forcerun publish.
rule publish:
    input:
        unpack(publish_inputs),
    output:
        "results/computations/{cdigest}/publication.json",
    log:
        "logs/publish/{cdigest}.log",
    conda:
        "../../envs/minifield.yaml"
    params:
        store_dir=STORE_DIR,
        lock_timeout_s=config["store"]["lock_timeout_s"],
        no_proof=publish_proof_waiver,
    script:
        "../scripts/publish.py"


rule activate:
    input:
        publication="results/computations/{cdigest}/publication.json",
    output:
        "results/computations/{cdigest}/activation.json",
    log:
        "logs/activate/{cdigest}.log",
    conda:
        "../../envs/minifield.yaml"
    params:
        store_dir=STORE_DIR,
        lock_timeout_s=config["store"]["lock_timeout_s"],
    script:
        "../scripts/activate.py"
