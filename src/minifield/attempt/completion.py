"""A training that reached ``max_steps``, completed: the final evaluation (checked finite, its
``evaluation`` event marked final), the export (process 0 only) and the final state hash."""

from __future__ import annotations

import time
from pathlib import Path

from ..state import export
from ..state.arrays import STATE_HASH_VERSION
from ..supervision import distributed
from .events import EventLog
from .result import Ending, Progress
from .update_loop import HostSnapshot, check_evaluation


def complete(
    program,
    state,
    step: int,
    *,
    group: distributed.Group,
    events: EventLog,
    progress: Progress,
    snapshot: HostSnapshot,
    export_dir: Path,
) -> Ending:
    """The final evaluation, the export into ``export_dir`` and the final state hash."""
    import jax

    from ..state.arrays import to_host

    if group.size > 1:
        # one host copy on every process (a collective when sharded over processes), so
        # that process 0 alone can export it afterwards
        state = jax.tree_util.tree_map(to_host, state)
    started = time.monotonic()
    final_metrics = program.evaluate(state)
    check_evaluation(step, final_metrics)
    progress.metrics.update(final_metrics)
    events.emit(
        "evaluation",
        step=step,
        metrics=final_metrics,
        seconds=time.monotonic() - started,
        final=True,
    )
    if group.is_writer:
        export.write_whole(export_dir, lambda partial: program.export(state, partial))
    progress.final_state_hash = snapshot.hash_of(state, step)
    progress.state_hash_version = STATE_HASH_VERSION
    return Ending.completed()
