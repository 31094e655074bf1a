# Thin adapter: snakemake object -> minifield.stages.train_attempt
import sys
from pathlib import Path

from minifield import stages

sys.stderr = open(snakemake.log[0], "a")  # noqa: F821
stages.train_attempt(
    Path(snakemake.input.recipe),  # noqa: F821
    Path(snakemake.params.input_root),  # noqa: F821
    Path(snakemake.input.examples).parent,  # noqa: F821
    Path(snakemake.params.work_dir),  # noqa: F821
    Path(snakemake.output.result),  # noqa: F821
    Path(snakemake.output.export),  # noqa: F821
    Path(snakemake.log[0]),  # noqa: F821
    record_state_hashes=snakemake.params.record_state_hashes,  # noqa: F821
    allow_environment_change=snakemake.params.allow_environment_change,  # noqa: F821
)
