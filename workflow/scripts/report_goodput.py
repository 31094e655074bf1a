# Thin adapter: snakemake object -> minifield.observe.reporting.plot_goodput + throughput_table
import sys
from pathlib import Path

from minifield.observe import reporting

sys.stderr = open(snakemake.log[0], "w")
reporting.plot_goodput(Path(snakemake.input.summary), Path(snakemake.output.figure))
reporting.throughput_table(Path(snakemake.input.summary), Path(snakemake.output.table))
