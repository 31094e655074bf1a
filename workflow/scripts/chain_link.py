# Thin adapter: snakemake object -> minifield.pipeline.chains.link
import sys
from pathlib import Path

from minifield.pipeline import chains
from minifield.pipeline.errors import refusals

sys.stderr = open(snakemake.log[0], "w")
inputs = dict(snakemake.input.items())
with refusals("chain_link"):
    chains.link(
        snakemake.params.kind,
        Path(inputs["written"]),
        Path(inputs["product"]),
        Path(snakemake.params.input_root),
        Path(snakemake.output.recipe),
        Path(snakemake.output.root),
        *(Path(inputs[key]) for key in ("upstream_recipe", "upstream_metrics") if key in inputs),
    )
