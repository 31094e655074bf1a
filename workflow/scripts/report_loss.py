# Thin adapter: snakemake object -> minifield.observe.reporting.plot_loss
import sys
from pathlib import Path

from minifield.observe import reporting

sys.stderr = open(snakemake.log[0], "w")
reporting.plot_loss(
    Path(snakemake.input.result),
    Path(snakemake.input.metrics),
    Path(snakemake.output[0]),
)
