# Thin adapter: snakemake object -> minifield.pipeline.chains.link
import sys
from pathlib import Path

from minifield.pipeline import chains

sys.stderr = open(snakemake.log[0], "w")
inputs = snakemake.input
chains.link(
    snakemake.params.kind,
    Path(inputs.written),
    Path(inputs.upstream_recipe),
    Path(inputs.upstream_metrics),
    Path(inputs.product),
    Path(snakemake.params.input_root),
    Path(snakemake.output.recipe),
    Path(snakemake.output.root),
)
