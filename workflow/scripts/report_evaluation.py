# Thin adapter: snakemake object -> minifield.observe.report.results.evaluation_table
import sys
from pathlib import Path

from minifield.observe.report import results

sys.stderr = open(snakemake.log[0], "w")
results.evaluation_table(Path(snakemake.input.metrics), Path(snakemake.output[0]))
