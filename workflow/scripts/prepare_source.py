# Thin adapter: snakemake object -> minifield.pipeline.preparation.prepare_source
import sys
from pathlib import Path

from minifield.pipeline import preparation
from minifield.pipeline.errors import refusals

sys.stderr = open(snakemake.log[0], "w")
with refusals("prepare_source"):
    preparation.prepare_source(
        Path(snakemake.input.recipe),
        Path(snakemake.params.input_root),
        snakemake.params.source,
        Path(snakemake.output[0]).parent,
    )
