# Thin adapter: snakemake object -> minifield.observe.capacity.table
import sys
from pathlib import Path

from minifield.observe import capacity

sys.stderr = open(snakemake.log[0], "w")
capacity.table(
    [Path(p) for p in snakemake.input],
    Path(snakemake.output[0]),
)
