# Thin adapter: snakemake object -> minifield.observe.report.outcome
import sys
from pathlib import Path

from minifield.observe.report import outcome

sys.stderr = open(snakemake.log[0], "w")
lines = outcome.closing_summary(
    outcome.computations_in(list(snakemake.input)),
    Path("results/computations"),
    Path(snakemake.params.store_dir),
)
outcome.outcome_page(lines, Path(snakemake.output[0]))
