# Thin adapter: snakemake object -> minifield.observe.report.training.plot_goodput + throughput_table
import sys
from pathlib import Path

from minifield.observe.report import training

sys.stderr = open(snakemake.log[0], "w")
training.plot_goodput(Path(snakemake.input.summary), Path(snakemake.output.figure))
training.throughput_table(Path(snakemake.input.summary), Path(snakemake.output.table))
