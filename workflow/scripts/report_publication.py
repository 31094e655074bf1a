# Thin adapter: snakemake object -> minifield.observe.reporting.publication_table
# The input is absent (an empty list) when the workflow has no rule that makes it.
import sys
from pathlib import Path

from minifield.observe import reporting

sys.stderr = open(snakemake.log[0], "w")
given = snakemake.input.get("publication")
reporting.publication_table(Path(given) if given else None, Path(snakemake.output[0]))
