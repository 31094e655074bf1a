# Thin adapter: snakemake object -> minifield.stages.qualify
import sys
from pathlib import Path

from minifield import stages, supervise

sys.stderr = open(snakemake.log[0], "a")  # noqa: F821
q = snakemake.params.qualification  # noqa: F821
t = snakemake.config["train"]  # noqa: F821  (operational: not a rerun trigger)
stages.qualify(
    Path(snakemake.input.recipe),  # noqa: F821
    Path(snakemake.params.input_root),  # noqa: F821
    Path(snakemake.input.examples).parent,  # noqa: F821
    Path(snakemake.params.work_dir),  # noqa: F821
    Path(snakemake.output[0]),  # noqa: F821
    Path(snakemake.log[0]),  # noqa: F821
    steps=q["steps"],
    fail_after_step=q["fail_after_step"],
    mode=q["mode"],
    supervision=supervise.Settings(
        deadline_s=q["deadline_seconds"],
        stall_s=q["stall_seconds"],
        grace_s=t["grace_seconds"],
    ),
    gpus=t["gpus"],
    gpus_per_job=t["gpus_per_job"],
    lease_dir=Path(snakemake.params.lease_dir),  # noqa: F821
    lease_wait_s=t["lease_wait_seconds"],
    processes=t["processes"],
)
