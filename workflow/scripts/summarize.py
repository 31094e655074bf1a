# Thin adapter: snakemake object -> minifield.summarize.summarize_training
import sys
from pathlib import Path

from minifield import summarize

sys.stderr = open(snakemake.log[0], "w")  # noqa: F821
summarize.summarize_training(
    Path(snakemake.input.result),  # noqa: F821
    Path(snakemake.output[0]),  # noqa: F821
)
