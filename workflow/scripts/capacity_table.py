# Thin adapter: snakemake object -> minifield.observe.capacity_scenarios.table
import sys
from pathlib import Path

from minifield.observe import capacity_scenarios

sys.stderr = open(snakemake.log[0], "w")
capacity_scenarios.table(
    [Path(p) for p in snakemake.input],
    Path(snakemake.output[0]),
)
