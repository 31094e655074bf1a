# Helpers: config validation, the computations table, input functions.
from minifield import pipeline
from snakemake.utils import validate


validate(config, schema="../schemas/config.schema.json")

COMPUTATIONS = pipeline.load_computations(config)
INPUT_ROOT = config["input_root"]
WORK_DIR = config["work_dir"]
# GPU lease lock files, shared by every computation's jobs.
LEASE_DIR = f"{WORK_DIR}/gpu-leases"


wildcard_constraints:
    cdigest="[0-9a-f]{16}",
    edigest="[0-9a-f]{16}",


def recipe_file(wildcards):
    return str(COMPUTATIONS[wildcards.cdigest].path)


def pinned_input_files(wildcards):
    return pipeline.input_paths(COMPUTATIONS[wildcards.cdigest], INPUT_ROOT)


def examples_recipe(wildcards):
    computation = pipeline.for_examples(COMPUTATIONS, wildcards.edigest)
    return f"results/computations/{computation.cdigest}/recipe.json"


def examples_inputs_record(wildcards):
    computation = pipeline.for_examples(COMPUTATIONS, wildcards.edigest)
    return f"results/computations/{computation.cdigest}/inputs.json"


def examples_manifest(wildcards):
    return f"results/examples/{COMPUTATIONS[wildcards.cdigest].edigest}/manifest.json"


def work_dir(wildcards):
    return f"{WORK_DIR}/{wildcards.cdigest}"


def final_targets():
    return [
        f"results/computations/{cdigest}/eval/metrics.json" for cdigest in sorted(COMPUTATIONS)
    ]
