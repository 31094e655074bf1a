# Thin adapter: snakemake object -> minifield.observe.summarize.summarize_training
import sys
from pathlib import Path

from minifield.observe import summarize

sys.stderr = open(snakemake.log[0], "w")
summarize.summarize_training(
    Path(snakemake.input.result),
    Path(snakemake.output[0]),
)
