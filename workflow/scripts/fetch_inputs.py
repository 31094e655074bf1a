# Thin adapter: snakemake object -> minifield.inputs.fetch.stage
import sys
from pathlib import Path

from minifield.inputs import fetch

sys.stderr = open(snakemake.log[0], "w")
fetch.stage(
    Path(snakemake.input.recipe),
    snakemake.config["remote_inputs"],
    Path(snakemake.params.work_dir),
    Path(snakemake.params.input_root),
    Path(snakemake.output.root),
    Path(snakemake.output.record),
)
