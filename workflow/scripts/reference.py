# Thin adapter: snakemake object -> minifield.pipeline.reference_logprobs.compute
import sys
from pathlib import Path

from minifield.pipeline import reference_logprobs
from minifield.pipeline.errors import refusals

sys.stderr = open(snakemake.log[0], "w")
with refusals("reference"):
    reference_logprobs.compute(
        Path(snakemake.input.recipe),
        Path(snakemake.params.input_root),
        Path(snakemake.output[0]),
    )
