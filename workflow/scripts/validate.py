# Thin adapter: snakemake object -> minifield.pipeline.preparation.validate
import sys
from pathlib import Path

from minifield.pipeline import preparation

sys.stderr = open(snakemake.log[0], "w")
preparation.validate(
    Path(snakemake.input.recipe),
    Path(snakemake.output.recipe),
    Path(snakemake.output.validation),
)
