# Delivery to an MLflow tracking server (docs/tracking.md), only with tracking.enabled: true.
# One run per computation (params, tags, evaluation metrics, evidence and report plots as
# artifacts) and a nested run per training attempt with every update's metrics. Resumes from
# the cursors in tracking.state_dir, so events the live delivery already sent are not resent.
# The output is named by the destination (tracking_destination: uri and experiment), so
# pointing tracking.uri at another server makes a new target that delivers everything there.
rule deliver:
    input:
        unpack(deliver_inputs),
    output:
        "results/computations/{cdigest}/tracking/{destination}.json",
    log:
        "logs/deliver/{cdigest}-{destination}.log",
    conda:
        "../../envs/minifield.yaml"
    params:
        work_dir=work_dir,
    script:
        "../scripts/deliver.py"
