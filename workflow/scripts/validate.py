# Thin adapter: snakemake object -> minifield.pipeline.stages.validate
import sys
from pathlib import Path

from minifield.pipeline import stages

sys.stderr = open(snakemake.log[0], "w")
stages.validate(
    Path(snakemake.input.recipe),
    Path(snakemake.output.recipe),
    Path(snakemake.output.validation),
)
