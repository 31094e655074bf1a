# Thin adapter: snakemake object -> minifield.store.publish_computation
import sys
from pathlib import Path

from minifield import store
from minifield.pipeline.errors import refusals

sys.stderr = open(snakemake.log[0], "w")
mirror = None
if (snakemake.config.get("tracking") or {}).get("enabled"):
    from minifield.tracking import registry, settings

    mirror = registry.RegistryMirror(settings.from_config(snakemake.config))
inputs = snakemake.input
with refusals("publish"):
    store.publish_computation(
        Path(snakemake.params.store_dir),
        Path(inputs.export),
        Path(inputs.recipe),
        Path(inputs.result),
        Path(inputs.metrics),
        Path(inputs.proof) if "proof" in inputs.keys() else None,
        Path(snakemake.output[0]),
        no_proof=snakemake.params.no_proof or None,
        lock_timeout=snakemake.params.lock_timeout_s,
        mirror=mirror,
    )
