# Thin adapter: snakemake object -> minifield.pipeline.rl_before_after.compare; a failed check
# (after < before - tolerance) ends the job with exit 1 and its one-line message
import sys
from pathlib import Path

from minifield.pipeline import rl_before_after

sys.stderr = open(snakemake.log[0], "w")
inputs = snakemake.input
try:
    rl_before_after.compare(
        Path(inputs.before),
        Path(inputs.after),
        {split: Path(inputs[split]) for split in ("dev", "test")},
        {name: Path(inputs[name]) for name in snakemake.params.reward_files},
        Path(inputs.recipe),
        Path(snakemake.output.record),
        Path(snakemake.output.table),
    )
except rl_before_after.RewardDrop as refused:
    for stream in (sys.stderr, sys.__stderr__):
        print(f"rl_before_after: {refused}", file=stream, flush=True)
    sys.exit(1)
