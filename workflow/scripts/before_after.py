# Thin adapter: snakemake object -> minifield.pipeline.before_after.compare; a failed check
# (after < before - tolerance) ends the job with exit 1 and its one-line message
import sys
from pathlib import Path

from minifield.pipeline import before_after

sys.stderr = open(snakemake.log[0], "w")
inputs = snakemake.input
try:
    before_after.compare(
        Path(inputs.before),
        Path(inputs.after),
        {split: Path(inputs[split]) for split in ("dev", "test")},
        Path(snakemake.output.record),
        Path(snakemake.output.table),
        Path(inputs.recipe),
    )
except before_after.DevExactMatchDrop as refused:
    for stream in (sys.stderr, sys.__stderr__):
        print(f"before_after: {refused}", file=stream, flush=True)
    sys.exit(1)
