# Thin adapter: snakemake object -> minifield.pipeline.preparation.fetch_inputs
import sys
from pathlib import Path

from minifield.pipeline import preparation
from minifield.pipeline.errors import refusals

sys.stderr = open(snakemake.log[0], "w")
with refusals("fetch_inputs"):
    preparation.fetch_inputs(
        Path(snakemake.input.recipe),
        snakemake.config["remote_inputs"],
        Path(snakemake.params.work_dir),
        Path(snakemake.params.input_root),
        Path(snakemake.output.root),
        Path(snakemake.output.record),
    )
