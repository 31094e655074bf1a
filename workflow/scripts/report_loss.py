# Thin adapter: snakemake object -> minifield.observe.report.training.plot_loss
import sys
from pathlib import Path

from minifield.observe.report import training

sys.stderr = open(snakemake.log[0], "w")
training.plot_loss(
    Path(snakemake.input.result),
    Path(snakemake.input.metrics),
    Path(snakemake.output[0]),
)
