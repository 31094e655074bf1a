# Thin adapter: snakemake object -> minifield.pipeline.reference_logprobs.compute
import sys
from pathlib import Path

from minifield.pipeline import reference_logprobs

sys.stderr = open(snakemake.log[0], "w")
reference_logprobs.compute(
    Path(snakemake.input.recipe),
    Path(snakemake.params.input_root),
    Path(snakemake.output[0]),
)
