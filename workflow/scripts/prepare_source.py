# Thin adapter: snakemake object -> minifield.pipeline.preparation.prepare_source
import sys
from pathlib import Path

from minifield.pipeline import preparation

sys.stderr = open(snakemake.log[0], "w")
preparation.prepare_source(
    Path(snakemake.input.recipe),
    Path(snakemake.params.input_root),
    snakemake.params.source,
    Path(snakemake.output[0]).parent,
)
