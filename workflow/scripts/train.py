# Thin adapter: snakemake object -> minifield.stages.train_attempt
import sys
from pathlib import Path

from minifield import stages, supervise

sys.stderr = open(snakemake.log[0], "a")  # noqa: F821
t = snakemake.config["train"]  # noqa: F821  (operational: not a rerun trigger)
stages.train_attempt(
    Path(snakemake.input.recipe),  # noqa: F821
    Path(snakemake.params.input_root),  # noqa: F821
    Path(snakemake.input.examples).parent,  # noqa: F821
    Path(snakemake.params.work_dir),  # noqa: F821
    Path(snakemake.output.result),  # noqa: F821
    Path(snakemake.output.export),  # noqa: F821
    Path(snakemake.log[0]),  # noqa: F821
    proof=Path(snakemake.input.proof),  # noqa: F821
    record_state_hashes=t["record_state_hashes"],
    allow_environment_change=t["allow_environment_change"],
    supervision=supervise.Settings(
        deadline_s=t["deadline_seconds"],
        stall_s=t["stall_seconds"],
        grace_s=t["grace_seconds"],
    ),
    gpus=t["gpus"],
    gpus_per_job=t["gpus_per_job"],
    lease_dir=Path(snakemake.params.lease_dir),  # noqa: F821
    lease_wait_s=t["lease_wait_seconds"],
    processes=t["processes"],
)
