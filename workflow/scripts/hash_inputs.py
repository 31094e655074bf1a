# Thin adapter: snakemake object -> minifield.stages.hash_inputs
import sys
from pathlib import Path

from minifield import stages

sys.stderr = open(snakemake.log[0], "w")  # noqa: F821
stages.hash_inputs(
    Path(snakemake.input.recipe),  # noqa: F821
    Path(snakemake.params.input_root),  # noqa: F821
    Path(snakemake.output[0]),  # noqa: F821
)
