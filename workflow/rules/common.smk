# Helpers: config validation, the computations table, input functions.
import sys
from pathlib import Path

from minifield.pipeline import computations, host, workflow_config
from minifield.supervision import accelerator
from snakemake.utils import validate

# Only a worker opens the accelerator: this process and every job's script process run JAX on
# the CPU, the workers and evaluation children they start get the platforms given here.
accelerator.keep_off()
# benchmark files on a host whose /proc/<pid>/io psutil cannot parse (gVisor): time, no I/O
host.io_counters_as_missing_where_partial()

# the file, the field and the expectation, exit 2 (Snakemake's validate: a schema dump, exit 1)
workflow_config.require_valid(config, workflow.configfiles)
validate(config, schema="../schemas/config.schema.json")

COMPUTATIONS = computations.load_computations(config)
INPUT_ROOT = config["input_root"]
WORK_DIR = config["work_dir"]
STORE_DIR = config["store"]["dir"]
# GPU lease lock files, shared by every computation's jobs.
LEASE_DIR = f"{WORK_DIR}/gpu-leases"
# Training sources prepared on their own (a mixture's), by source digest.
SOURCES_DIR = "results/sources"
# Quantized bases (model.lora.base_quantization), by quantized-base digest.
QUANTIZED_DIR = "results/quantized-bases"


def recipe_file(wildcards):
    return str(COMPUTATIONS[wildcards.cdigest].path)


def local_input_files(wildcards):
    return computations.input_paths(COMPUTATIONS[wildcards.cdigest], INPUT_ROOT)


def pinned_input_files(wildcards):
    """Local input files, or the fetched input root of a computation with url inputs."""
    computation = COMPUTATIONS[wildcards.cdigest]
    return computations.fetched_roots(computation) or computations.input_paths(
        computation, INPUT_ROOT
    )


def fetched_input_root(wildcards):
    """The fetched input root of a computation with url inputs (nothing for local-only ones)."""
    return computations.fetched_roots(COMPUTATIONS[wildcards.cdigest])


def computation_input_root(wildcards):
    return computations.input_root(COMPUTATIONS[wildcards.cdigest], INPUT_ROOT)


def examples_input_root(wildcards):
    computation = computations.for_examples(COMPUTATIONS, wildcards.edigest)
    return computations.input_root(computation, INPUT_ROOT)


def examples_fetched_root(wildcards):
    return computations.fetched_roots(
        computations.for_examples(COMPUTATIONS, wildcards.edigest)
    )


def examples_recipe(wildcards):
    computation = computations.for_examples(COMPUTATIONS, wildcards.edigest)
    return f"results/computations/{computation.cdigest}/recipe.json"


def examples_inputs_record(wildcards):
    computation = computations.for_examples(COMPUTATIONS, wildcards.edigest)
    return f"results/computations/{computation.cdigest}/inputs.json"


def examples_sources(wildcards):
    """The training sources a computation prepares on their own (a mixture's), shared by
    every recipe with the same source."""
    computation = computations.for_examples(COMPUTATIONS, wildcards.edigest)
    return [f"{SOURCES_DIR}/{d}/manifest.json" for d in computation.sdigests.values()]


def source_inputs(wildcards):
    """Recipe, verified inputs and fetched root of a computation with the source {sdigest}."""
    computation, _ = computations.for_source(COMPUTATIONS, wildcards.sdigest)
    base = f"results/computations/{computation.cdigest}"
    return {
        "recipe": f"{base}/recipe.json",
        "inputs": f"{base}/inputs.json",
        "fetched": computations.fetched_roots(computation),
    }


def source_input_root(wildcards):
    computation, _ = computations.for_source(COMPUTATIONS, wildcards.sdigest)
    return computations.input_root(computation, INPUT_ROOT)


def source_name(wildcards):
    return computations.for_source(COMPUTATIONS, wildcards.sdigest)[1]


def quantized_base_inputs(wildcards):
    """Recipe and prepared examples of a computation with the quantized base {qdigest}."""
    computation = computations.for_quantized_base(COMPUTATIONS, wildcards.qdigest)
    return {
        "recipe": f"results/computations/{computation.cdigest}/recipe.json",
        "examples": f"results/examples/{computation.edigest}/manifest.json",
    }


def quantized_base_manifest(wildcards):
    """The quantized base a computation trains on (nothing when its base is not quantized)."""
    qdigest = COMPUTATIONS[wildcards.cdigest].qdigest
    return [] if qdigest is None else f"{QUANTIZED_DIR}/{qdigest}/manifest.json"


def examples_manifest(wildcards):
    return f"results/examples/{COMPUTATIONS[wildcards.cdigest].edigest}/manifest.json"


def work_dir(wildcards):
    return f"{WORK_DIR}/{wildcards.cdigest}"


def training_resources():
    """Resources of the qualify and train jobs: the GPU request, and for a multi-process
    attempt the tasks to run it in. The SLURM executor submits `tasks` as `--ntasks`; `mpi`
    tells its job step to run the job as it is, not inside a one-task `srun`, because the
    job starts its own `srun` of that many tasks (minifield.supervision.launch)."""
    train = config["train"]
    resources = {"gpu": train["request_gpus"], **chip_resources()}
    if train["processes"] > 1:
        resources.update(tasks=train["processes"], mpi="srun")
    return resources


def evaluation_resources():
    """Resources of the evaluate job: the TPU chip, and for an evaluation over several
    processes the tasks to run them in (as for training, see training_resources)."""
    processes = config["evaluate"]["processes"]
    tasks = {"tasks": processes, "mpi": "srun"} if processes > 1 else {}
    return {**tasks, **chip_resources()}


def chip_resources():
    """The TPU chip as one Snakemake resource (config `tpu`): each job whose processes open
    the accelerator (qualify's and train's workers, evaluate's child for a recipe naming it)
    requests it, so with the global limit tpu=1 (profiles/default) they run one at a time;
    libtpu lets one process hold the chip. Every other job keeps off it (its JAX on the CPU:
    minifield.supervision.accelerator). Nothing when the config says no TPU.
    """
    return {"tpu": 1} if config["tpu"] else {}


def proof_required():
    """Whether publication needs the recovery proof: store.require_proof, where "auto" means
    "when this workflow has a qualify rule" (rules.has, because hasattr(rules, ...) raises).
    """
    setting = config["store"]["require_proof"]
    if setting == "auto":
        return rules.has("qualify")
    return setting in (True, "true")


def publish_inputs(wildcards):
    base = f"results/computations/{wildcards.cdigest}"
    inputs = {
        "recipe": f"{base}/recipe.json",
        "result": f"{base}/train/result.json",
        "export": f"{base}/train/export",
        "metrics": f"{base}/eval/metrics.json",
    }
    if proof_required():
        inputs["proof"] = f"{base}/qualification/proof.json"
    return inputs


def publish_proof_waiver(wildcards):
    """The recorded reason for publishing without a proof ("" when a proof is required)."""
    if proof_required():
        return ""
    if config["store"]["require_proof"] == "auto":
        return "this workflow defines no qualify step (store.require_proof: auto)"
    return "store.require_proof is false in the workflow config"


def final_targets():
    targets = []
    for cdigest in sorted(COMPUTATIONS):
        base = f"results/computations/{cdigest}"
        targets += [
            f"{base}/eval/metrics.json",
            f"{base}/publication.json",
            f"{base}/capacity.json",
        ]
        if config["store"]["activate"]:
            targets.append(f"{base}/activation.json")
        if config["tracking"]["enabled"]:
            targets.append(f"{base}/tracking/{tracking_destination()}.json")
    return targets + ["results/capacity.csv"] + report_targets()


def computation_label(wildcards):
    """Report subcategory of a computation: its job id and short digest."""
    return f"{COMPUTATIONS[wildcards.cdigest].recipe.job_id} ({wildcards.cdigest})"


def report_labels(item):
    """Report labels of one item of a computation (a function of the wildcards)."""

    def labels(wildcards):
        return {
            "job": COMPUTATIONS[wildcards.cdigest].recipe.job_id,
            "computation": wildcards.cdigest,
            "item": item,
        }

    return labels


# Report items fed by optional rules: the input exists only if the workflow has the rule,
# so the report never waits for a file nothing can make (and never hides one that can).
# (`hasattr(rules, name)` does not work: Snakemake's Rules raises WorkflowError, not
# AttributeError, for an unknown rule; `rules.has(name)` is the supported test.)
def qualification_proof(wildcards):
    if rules.has("qualify"):
        return f"results/computations/{wildcards.cdigest}/qualification/proof.json"
    return []


def publication_record(wildcards):
    if rules.has("publish"):
        return f"results/computations/{wildcards.cdigest}/publication.json"
    return []


def capacity_csv(wildcards):
    return "results/capacity.csv" if rules.has("capacity_table") else []


REPORT_ITEMS = ["loss.png", "goodput.png", "throughput.html", "recovery.html"]
REPORT_ITEMS += ["evaluation.html", "publication.html"]


def report_targets():
    """Every file the report shows; `snakemake --report` aborts if one is missing."""
    targets = ["results/report/outcome.html", "results/report/capacity.html"]
    for cdigest in sorted(COMPUTATIONS):
        targets.append(f"results/computations/{cdigest}/summary.json")
        targets += [
            f"results/computations/{cdigest}/report/{item}" for item in REPORT_ITEMS
        ]
    return targets


def tracking_destination():
    """The configured tracking server and experiment as a key (the deliver rule's output)."""
    from minifield.tracking import settings

    return settings.from_config(config).destination


def deliver_inputs(wildcards):
    """The inputs of the delivery to the tracking server: evaluation, summary and report
    plots, the proof and the publication (so that the registry version exists before the
    run is closed). Its wording avoids the word before a colon that the linter takes for a
    rule definition."""
    base = f"results/computations/{wildcards.cdigest}"
    inputs = {
        "recipe": f"{base}/recipe.json",
        "validation": f"{base}/validation.json",
        "result": f"{base}/train/result.json",
        "metrics": f"{base}/eval/metrics.json",
        "summary": f"{base}/summary.json",
        "plots": [f"{base}/report/loss.png", f"{base}/report/goodput.png"],
    }
    if rules.has("qualify"):
        inputs["proof"] = f"{base}/qualification/proof.json"
    if rules.has("publish"):
        inputs["publication"] = f"{base}/publication.json"
    return inputs


def print_refusals(run_log):
    """The refusals of the run's failed stages, one line each, on stderr (the onerror handler)."""
    from minifield.pipeline.errors import refusal_lines

    for line in refusal_lines(run_log):
        print(line, file=sys.stderr)


def print_closing_summary():
    """What the run did, one line per computation, on stderr (the onsuccess handler)."""
    from minifield.observe.report import outcome

    cdigests = [computation.cdigest for computation in COMPUTATIONS.every()]
    lines = outcome.closing_summary(
        cdigests, Path("results/computations"), Path(STORE_DIR)
    )
    if lines:
        print("minifield: what this run did, per computation:", file=sys.stderr)
    for line in lines:
        print(f"  {line}", file=sys.stderr)


def outcome_inputs(wildcards):
    """What the closing summary's report item reads: each configured computation's
    evaluation, publication and activation (the chained ones' through chain_targets)."""
    inputs = []
    for cdigest in sorted(COMPUTATIONS):
        base = f"results/computations/{cdigest}"
        inputs.append(f"{base}/eval/metrics.json")
        if rules.has("publish"):
            inputs.append(f"{base}/publication.json")
        if config["store"]["activate"]:
            inputs.append(f"{base}/activation.json")
    return inputs
