# Thin adapter: snakemake object -> minifield.observe.reporting.evaluation_table
import sys
from pathlib import Path

from minifield.observe import reporting

sys.stderr = open(snakemake.log[0], "w")
reporting.evaluation_table(Path(snakemake.input.metrics), Path(snakemake.output[0]))
