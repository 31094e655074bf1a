# Observability and the Snakemake report: a summary of the training events, then one
# figure or table per report item. Items fed by optional rules (qualify, publish,
# capacity) say so in the report when the workflow has no such rule.
rule summarize:
    input:
        result="results/computations/{cdigest}/train/result.json",
    output:
        "results/computations/{cdigest}/summary.json",
    log:
        "logs/summarize/{cdigest}.log",
    conda:
        "../../envs/minifield.yaml"
    script:
        "../scripts/summarize.py"


rule report_loss:
    input:
        result="results/computations/{cdigest}/train/result.json",
        metrics="results/computations/{cdigest}/eval/metrics.json",
    output:
        report(
            "results/computations/{cdigest}/report/loss.png",
            caption="../report/loss.rst",
            category="1. Loss curves",
            subcategory=computation_label,
            labels=report_labels("loss curves"),
        ),
    log:
        "logs/report_loss/{cdigest}.log",
    conda:
        "../../envs/minifield.yaml"
    script:
        "../scripts/report_loss.py"


rule report_goodput:
    input:
        summary="results/computations/{cdigest}/summary.json",
    output:
        figure=report(
            "results/computations/{cdigest}/report/goodput.png",
            caption="../report/goodput.rst",
            category="2. Throughput and goodput",
            subcategory=computation_label,
            labels=report_labels("goodput chart"),
        ),
        table=report(
            "results/computations/{cdigest}/report/throughput.html",
            caption="../report/throughput.rst",
            category="2. Throughput and goodput",
            subcategory=computation_label,
            labels=report_labels("throughput table"),
        ),
    log:
        "logs/report_goodput/{cdigest}.log",
    conda:
        "../../envs/minifield.yaml"
    script:
        "../scripts/report_goodput.py"


rule report_recovery:
    input:
        proof=qualification_proof,
    output:
        report(
            "results/computations/{cdigest}/report/recovery.html",
            caption="../report/recovery.rst",
            category="3. Recovery proof",
            subcategory=computation_label,
            labels=report_labels("recovery proof"),
        ),
    log:
        "logs/report_recovery/{cdigest}.log",
    conda:
        "../../envs/minifield.yaml"
    script:
        "../scripts/report_recovery.py"


rule report_evaluation:
    input:
        metrics="results/computations/{cdigest}/eval/metrics.json",
    output:
        report(
            "results/computations/{cdigest}/report/evaluation.html",
            caption="../report/evaluation.rst",
            category="4. Evaluation",
            subcategory=computation_label,
            labels=report_labels("evaluation table"),
        ),
    log:
        "logs/report_evaluation/{cdigest}.log",
    conda:
        "../../envs/minifield.yaml"
    script:
        "../scripts/report_evaluation.py"


rule report_publication:
    input:
        publication=publication_record,
    output:
        report(
            "results/computations/{cdigest}/report/publication.html",
            caption="../report/publication.rst",
            category="5. Publication",
            subcategory=computation_label,
            labels=report_labels("publication record"),
        ),
    log:
        "logs/report_publication/{cdigest}.log",
    conda:
        "../../envs/minifield.yaml"
    script:
        "../scripts/report_publication.py"


rule report_capacity:
    input:
        capacity=capacity_csv,
    output:
        report(
            "results/report/capacity.html",
            caption="../report/capacity.rst",
            category="6. Capacity",
            labels={"table": "capacity plan"},
        ),
    log:
        "logs/report_capacity/all.log",
    conda:
        "../../envs/minifield.yaml"
    script:
        "../scripts/report_capacity.py"


# The report's first item: what the run did per computation (the run's closing summary).
rule report_outcome:
    input:
        outcome_inputs,
        *chain_targets(),
    output:
        report(
            "results/report/outcome.html",
            caption="../report/outcome.rst",
            category="0. What the run did",
            labels={"table": "closing summary"},
        ),
    log:
        "logs/report_outcome/all.log",
    conda:
        "../../envs/minifield.yaml"
    params:
        store_dir=STORE_DIR,
    script:
        "../scripts/report_outcome.py"
