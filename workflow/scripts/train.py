# Thin adapter: snakemake object -> minifield.pipeline.training.train_attempt
import sys
from pathlib import Path

from minifield.pipeline import training
from minifield.pipeline.errors import refusals
from minifield.supervision import supervise

sys.stderr = open(snakemake.log[0], "a")
# the quantized base's manifest, or an empty list when the base is not quantized
quantized = snakemake.input.get("quantized")
t = snakemake.config["train"]  # operational: not a rerun trigger
live_delivery = None
if (snakemake.config.get("tracking") or {}).get("enabled"):
    from minifield.tracking import live, settings

    tracking = settings.from_config(snakemake.config)

    def live_delivery(attempt_dir):
        return live.LiveDelivery(
            tracking,
            attempt_dir,
            recipe_json=Path(snakemake.input.recipe),
            log_path=Path(snakemake.log[0]).with_suffix(".delivery.log"),
        )


with refusals("train"):
    training.train_attempt(
        Path(snakemake.input.recipe),
        Path(snakemake.params.input_root),
        Path(snakemake.input.examples).parent,
        Path(snakemake.params.work_dir),
        Path(snakemake.output.result),
        Path(snakemake.output.export),
        Path(snakemake.log[0]),
        quantized_base_dir=Path(quantized).parent if quantized else None,
        proof=Path(snakemake.input.proof),
        record_state_hashes=t["record_state_hashes"] and t.get("state_hash_every", 1),
        allow_environment_change=t["allow_environment_change"],
        supervision=supervise.Settings(
            deadline_s=t["deadline_seconds"],
            stall_s=t["stall_seconds"],
            grace_s=t["grace_seconds"],
        ),
        gpus=t["gpus"],
        gpus_per_job=t["gpus_per_job"],
        lease_dir=Path(snakemake.params.lease_dir),
        lease_wait_s=t["lease_wait_seconds"],
        processes=t["processes"],
        live_delivery=live_delivery,
    )
