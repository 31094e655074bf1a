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
    script:
        "../scripts/summarize.py"


rule plot_loss:
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
        "logs/plot_loss/{cdigest}.log",
    script:
        "../scripts/plot_loss.py"


rule plot_goodput:
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
        "logs/plot_goodput/{cdigest}.log",
    script:
        "../scripts/plot_goodput.py"


rule recovery_table:
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
        "logs/recovery_table/{cdigest}.log",
    script:
        "../scripts/recovery_table.py"


rule evaluation_table:
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
        "logs/evaluation_table/{cdigest}.log",
    script:
        "../scripts/evaluation_table.py"


rule publication_table:
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
        "logs/publication_table/{cdigest}.log",
    script:
        "../scripts/publication_table.py"


rule capacity_table:
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
        "logs/capacity_table/all.log",
    script:
        "../scripts/capacity_table.py"
