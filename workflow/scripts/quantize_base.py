# Thin adapter: snakemake object -> minifield.pipeline.preparation.quantize_base
import sys
from pathlib import Path

from minifield.pipeline import preparation
from minifield.pipeline.errors import refusals

sys.stderr = open(snakemake.log[0], "w")
with refusals("quantize_base"):
    preparation.quantize_base(
        Path(snakemake.input.recipe),
        Path(snakemake.input.examples).parent,
        Path(snakemake.output[0]).parent,
    )
