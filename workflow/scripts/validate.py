# Thin adapter: snakemake object -> minifield.pipeline.preparation.validate
import sys
from pathlib import Path

from minifield.pipeline import preparation
from minifield.pipeline.errors import refusals

sys.stderr = open(snakemake.log[0], "w")
with refusals("validate"):
    preparation.validate(
        Path(snakemake.input.recipe),
        Path(snakemake.output.recipe),
        Path(snakemake.output.validation),
    )
