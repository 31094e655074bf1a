# Thin adapter: snakemake object -> minifield.pipeline.stage_links.link
import sys
from pathlib import Path

from minifield.pipeline import stage_links

sys.stderr = open(snakemake.log[0], "w")
inputs = snakemake.input
stage_links.link(
    Path(inputs.stage2),
    Path(inputs.stage1_recipe),
    Path(inputs.stage1_metrics),
    Path(inputs.export),
    Path(snakemake.params.input_root),
    Path(snakemake.output.recipe),
    Path(snakemake.output.root),
)
