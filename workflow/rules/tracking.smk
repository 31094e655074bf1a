# Delivery to an MLflow tracking server (docs/tracking.md), only with tracking.enabled: true.
# One run per computation (params, tags, evaluation metrics, evidence and report plots as
# artifacts) and a nested run per training attempt with every update's metrics. Resumes from
# the cursors in tracking.state_dir, so events the live delivery already sent are not resent.
rule deliver:
    input:
        unpack(deliver_inputs),
    output:
        "results/computations/{cdigest}/tracking.json",
    log:
        "logs/deliver/{cdigest}.log",
    conda:
        "../../envs/minifield.yaml"
    params:
        work_dir=work_dir,
    script:
        "../scripts/deliver.py"
