# Thin adapter: snakemake object -> minifield.pipeline.preparation.hash_inputs
import sys
from pathlib import Path

from minifield.pipeline import preparation
from minifield.pipeline.errors import refusals

sys.stderr = open(snakemake.log[0], "w")
with refusals("hash_inputs"):
    preparation.hash_inputs(
        Path(snakemake.input.recipe),
        Path(snakemake.params.input_root),
        Path(snakemake.output[0]),
    )
