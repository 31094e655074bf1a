rule validate:
    input:
        recipe=recipe_file,
    output:
        recipe="results/computations/{cdigest}/recipe.json",
        validation="results/computations/{cdigest}/validation.json",
    log:
        "logs/validate/{cdigest}.log",
    conda:
        "../../envs/minifield.yaml"
    script:
        "../scripts/validate.py"
