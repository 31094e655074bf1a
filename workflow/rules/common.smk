# Helpers: config validation, the computations table, input functions.
from minifield import pipeline
from snakemake.utils import validate

validate(config, schema="../schemas/config.schema.json")

COMPUTATIONS = pipeline.load_computations(config)
INPUT_ROOT = config["input_root"]
WORK_DIR = config["work_dir"]


wildcard_constraints:
    cdigest="[0-9a-f]{16}",
    edigest="[0-9a-f]{16}",


def recipe_file(wildcards):
    return str(COMPUTATIONS[wildcards.cdigest].path)


def local_input_files(wildcards):
    return pipeline.input_paths(COMPUTATIONS[wildcards.cdigest], INPUT_ROOT)


def pinned_input_files(wildcards):
    """Local input files, or the fetched input root of a computation with url inputs."""
    computation = COMPUTATIONS[wildcards.cdigest]
    return pipeline.fetched_roots(computation) or pipeline.input_paths(
        computation, INPUT_ROOT
    )


def fetched_input_root(wildcards):
    """The fetched input root of a computation with url inputs (nothing for local-only ones)."""
    return pipeline.fetched_roots(COMPUTATIONS[wildcards.cdigest])


def computation_input_root(wildcards):
    return pipeline.input_root(COMPUTATIONS[wildcards.cdigest], INPUT_ROOT)


def examples_input_root(wildcards):
    computation = pipeline.for_examples(COMPUTATIONS, wildcards.edigest)
    return pipeline.input_root(computation, INPUT_ROOT)


def examples_fetched_root(wildcards):
    return pipeline.fetched_roots(
        pipeline.for_examples(COMPUTATIONS, wildcards.edigest)
    )


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
        f"results/computations/{cdigest}/eval/metrics.json"
        for cdigest in sorted(COMPUTATIONS)
    ]
