# Thin adapter: snakemake object -> minifield.stages.prepare
import sys
from pathlib import Path

from minifield import stages

sys.stderr = open(snakemake.log[0], "w")  # noqa: F821
stages.prepare(
    Path(snakemake.input.recipe),  # noqa: F821
    Path(snakemake.params.input_root),  # noqa: F821
    Path(snakemake.output[0]).parent,  # noqa: F821
)
