# Thin adapter: snakemake object -> minifield.pipeline.stage_links.comparison
import sys
from pathlib import Path

from minifield.pipeline import stage_links

sys.stderr = open(snakemake.log[0], "w")
inputs = snakemake.input


def optional(name):
    value = inputs.get(name) if name in inputs.keys() else None
    return Path(value) if value else None


stage_links.comparison(
    Path(inputs.stage1_metrics),
    Path(inputs.stage2_metrics),
    optional("baseline_metrics"),
    Path(inputs.stage2_recipe),
    optional("stage1_publication"),
    optional("stage2_publication"),
    Path(snakemake.output.comparison),
    Path(snakemake.output.table),
)
