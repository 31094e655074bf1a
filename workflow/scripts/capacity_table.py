# Thin adapter: snakemake object -> minifield.capacity.table
import sys
from pathlib import Path

from minifield import capacity

sys.stderr = open(snakemake.log[0], "w")  # noqa: F821
capacity.table(
    [Path(p) for p in snakemake.input],  # noqa: F821
    Path(snakemake.output[0]),  # noqa: F821
)
