# Thin adapter: snakemake object -> minifield.pipeline.evaluation.evaluate
import sys
from pathlib import Path

from minifield.attempt.options import computation_cache
from minifield.pipeline import evaluation
from minifield.pipeline.errors import refusals

# emptied, then appended to: the evaluation processes append their output to the same log,
# and a handle that is not in append mode would write over it
open(snakemake.log[0], "w").close()
sys.stderr = open(snakemake.log[0], "a")
# the quantized base's manifest, or an empty list when the base is not quantized
quantized = snakemake.input.get("quantized")
with refusals("evaluate"):
    evaluation.evaluate(
        Path(snakemake.input.recipe),
        Path(snakemake.input.result),
        Path(snakemake.input.examples).parent,
        Path(snakemake.output.metrics),
        Path(snakemake.output.selected_export),
        Path(snakemake.params.input_root),
        processes=snakemake.config["evaluate"]["processes"],  # operational: not a rerun trigger
        log=Path(snakemake.log[0]),
        quantized_base_dir=Path(quantized).parent if quantized else None,
        # the workers' cache: their programs loaded by the evaluation processes
        compilation_cache=computation_cache(Path(snakemake.params.work_dir)),
    )
