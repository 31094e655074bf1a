# Thin adapter: snakemake object -> minifield.reporting.plot_loss
import sys
from pathlib import Path

from minifield import reporting

sys.stderr = open(snakemake.log[0], "w")  # noqa: F821
reporting.plot_loss(
    Path(snakemake.input.result),  # noqa: F821
    Path(snakemake.input.metrics),  # noqa: F821
    Path(snakemake.output[0]),  # noqa: F821
)
