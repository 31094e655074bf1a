# Thin adapter: snakemake object -> minifield.observe.report.results.recovery_table
# The input is absent (an empty list) when the workflow has no rule that makes it.
import sys
from pathlib import Path

from minifield.observe.report import results

sys.stderr = open(snakemake.log[0], "w")
given = snakemake.input.get("proof")
results.recovery_table(Path(given) if given else None, Path(snakemake.output[0]))
