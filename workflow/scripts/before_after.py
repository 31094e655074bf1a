# Thin adapter: snakemake object -> minifield.pipeline.before_after.compare
import sys
from pathlib import Path

from minifield.pipeline import before_after

sys.stderr = open(snakemake.log[0], "w")
inputs = snakemake.input
before_after.compare(
    Path(inputs.before),
    Path(inputs.after),
    {split: Path(inputs[split]) for split in ("dev", "test")},
    Path(snakemake.output.record),
    Path(snakemake.output.table),
)
