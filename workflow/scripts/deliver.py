# Thin adapter: snakemake object -> minifield.tracking.computation.deliver_computation
import sys
from pathlib import Path

from minifield.tracking import computation, connection, delivery, settings

sys.stderr = open(snakemake.log[0], "w")
link = connection.Connection(settings.from_config(snakemake.config))
computation.deliver_computation(
    delivery.Delivery(link),
    Path(snakemake.output[0]).parent,
    Path(snakemake.params.work_dir),
    out_record=Path(snakemake.output[0]),
)
