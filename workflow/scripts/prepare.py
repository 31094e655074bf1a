# Thin adapter: snakemake object -> minifield.pipeline.preparation.prepare
import sys
from pathlib import Path

from minifield.pipeline import preparation
from minifield.pipeline.errors import refusals

sys.stderr = open(snakemake.log[0], "w")
with refusals("prepare"):
    preparation.prepare(
        Path(snakemake.input.recipe),
        Path(snakemake.params.input_root),
        Path(snakemake.output[0]).parent,
        Path(snakemake.params.sources_root),
    )
