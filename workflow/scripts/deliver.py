# Thin adapter: snakemake object -> minifield.tracking.computation.deliver_computation
import sys
from pathlib import Path

from minifield.tracking import computation, connection, delivery, settings

sys.stderr = open(snakemake.log[0], "w")
configured = settings.from_config(snakemake.config)
if snakemake.wildcards.destination != configured.destination:
    sys.exit(
        f"deliver: {snakemake.output[0]} names destination {snakemake.wildcards.destination}, "
        f"but tracking.uri/experiment in the config are destination {configured.destination}"
    )
out_record = Path(snakemake.output[0])  # results/computations/{cdigest}/tracking/{destination}.json
computation.deliver_computation(
    delivery.Delivery(connection.Connection(configured)),
    out_record.parents[1],
    Path(snakemake.params.work_dir),
    out_record=out_record,
)
