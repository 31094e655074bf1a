# Thin adapter: snakemake object -> minifield.reporting.evaluation_table
import sys
from pathlib import Path

from minifield import reporting

sys.stderr = open(snakemake.log[0], "w")
reporting.evaluation_table(Path(snakemake.input.metrics), Path(snakemake.output[0]))
