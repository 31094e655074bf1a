# Thin adapter: snakemake object -> minifield.observe.capacity.for_run
import sys
from pathlib import Path

from minifield.observe import capacity

sys.stderr = open(snakemake.log[0], "w")
capacity.for_run(
    Path(snakemake.input.result),
    Path(snakemake.input.recipe),
    dict(snakemake.params.assumptions),
    Path(snakemake.output[0]),
)
