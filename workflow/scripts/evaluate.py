# Thin adapter: snakemake object -> minifield.pipeline.stages.evaluate
import sys
from pathlib import Path

from minifield.pipeline import stages

sys.stderr = open(snakemake.log[0], "w")
stages.evaluate(
    Path(snakemake.input.recipe),
    Path(snakemake.input.result),
    Path(snakemake.input.examples).parent,
    Path(snakemake.output.metrics),
    Path(snakemake.output.selected_export),
)
