# Thin adapter: snakemake object -> minifield.fetch.stage
import sys
from pathlib import Path

from minifield import fetch

sys.stderr = open(snakemake.log[0], "w")  # noqa: F821
fetch.stage(
    Path(snakemake.input.recipe),  # noqa: F821
    snakemake.config["remote_inputs"],  # noqa: F821
    Path(snakemake.params.work_dir),  # noqa: F821
    Path(snakemake.params.input_root),  # noqa: F821
    Path(snakemake.output.root),  # noqa: F821
    Path(snakemake.output.record),  # noqa: F821
)
