# Thin adapter: snakemake object -> minifield.pipeline.training.qualify
import sys
from pathlib import Path

from minifield.pipeline import training
from minifield.pipeline.errors import refusals
from minifield.supervision import supervise

sys.stderr = open(snakemake.log[0], "a")
# the quantized base's manifest, or an empty list when the base is not quantized
quantized = snakemake.input.get("quantized")
q = snakemake.params.qualification
t = snakemake.config["train"]  # operational: not a rerun trigger
with refusals("qualify"):
    training.qualify(
        Path(snakemake.input.recipe),
        Path(snakemake.params.input_root),
        Path(snakemake.input.examples).parent,
        Path(snakemake.params.work_dir),
        Path(snakemake.output[0]),
        Path(snakemake.log[0]),
        quantized_base_dir=Path(quantized).parent if quantized else None,
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
        lease_dir=Path(snakemake.params.lease_dir),
        lease_wait_s=t["lease_wait_seconds"],
        processes=t["processes"],
    )
