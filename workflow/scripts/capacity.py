# Thin adapter: snakemake object -> minifield.capacity.for_run
import sys
from pathlib import Path

from minifield import capacity

sys.stderr = open(snakemake.log[0], "w")  # noqa: F821
capacity.for_run(
    Path(snakemake.input.result),  # noqa: F821
    Path(snakemake.input.recipe),  # noqa: F821
    dict(snakemake.params.assumptions),  # noqa: F821
    Path(snakemake.output[0]),  # noqa: F821
)
