# Thin adapter: snakemake object -> minifield.stages.validate
import sys
from pathlib import Path

from minifield import stages

sys.stderr = open(snakemake.log[0], "w")  # noqa: F821
stages.validate(
    Path(snakemake.input.recipe),  # noqa: F821
    Path(snakemake.output.recipe),  # noqa: F821
    Path(snakemake.output.validation),  # noqa: F821
)
