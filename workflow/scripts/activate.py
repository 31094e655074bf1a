# Thin adapter: snakemake object -> minifield.store.activate_publication
import sys
from pathlib import Path

from minifield import store
from minifield.pipeline.errors import refusals

sys.stderr = open(snakemake.log[0], "w")
mirror = None
if (snakemake.config.get("tracking") or {}).get("enabled"):
    from minifield.tracking import registry, settings

    mirror = registry.RegistryMirror(settings.from_config(snakemake.config))
with refusals("activate"):
    try:
        store.activate_publication(
            Path(snakemake.params.store_dir),
            Path(snakemake.input.publication),
            Path(snakemake.output[0]),
            lock_timeout=snakemake.params.lock_timeout_s,
            mirror=mirror,
        )
    except store.Refused as exc:
        # Name every failed check in the log; the pointer was left unchanged.
        print(f"activation refused; active.json unchanged: {exc}", file=sys.stderr)
        raise
