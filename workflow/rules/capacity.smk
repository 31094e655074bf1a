# Capacity: measured seconds per job of the real training run (from its raw events) combined
# with the hypothetical demand, workers, reserve and price of config "capacity".
rule capacity:
    input:
        recipe="results/computations/{cdigest}/recipe.json",
        result="results/computations/{cdigest}/train/result.json",
    output:
        "results/computations/{cdigest}/capacity.json",
    log:
        "logs/capacity/{cdigest}.log",
    conda:
        "../../envs/minifield.yaml"
    params:
        assumptions=config["capacity"],
    script:
        "../scripts/capacity.py"


rule capacity_table:
    input:
        expand(
            "results/computations/{cdigest}/capacity.json",
            cdigest=sorted(COMPUTATIONS),
        ),
    output:
        "results/capacity.csv",
    log:
        "logs/capacity_table/capacity.log",
    conda:
        "../../envs/minifield.yaml"
    script:
        "../scripts/capacity_table.py"
