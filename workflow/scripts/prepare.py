# Thin adapter: snakemake object -> minifield.pipeline.stages.prepare
import sys
from pathlib import Path

from minifield.pipeline import stages

sys.stderr = open(snakemake.log[0], "w")
stages.prepare(
    Path(snakemake.input.recipe),
    Path(snakemake.params.input_root),
    Path(snakemake.output[0]).parent,
)
