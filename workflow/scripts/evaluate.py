# Thin adapter: snakemake object -> minifield.stages.evaluate
import sys
from pathlib import Path

from minifield import stages

sys.stderr = open(snakemake.log[0], "w")  # noqa: F821
stages.evaluate(
    Path(snakemake.input.recipe),  # noqa: F821
    Path(snakemake.input.result),  # noqa: F821
    Path(snakemake.input.examples).parent,  # noqa: F821
    Path(snakemake.output.metrics),  # noqa: F821
    Path(snakemake.output.selected_export),  # noqa: F821
)
