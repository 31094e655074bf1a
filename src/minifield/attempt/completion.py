"""A training that reached ``max_steps``, completed: the final evaluation (checked finite, its
``evaluation`` event marked final), the export and the final state hash.

In a multi-process attempt the export is written by the processes together, each the slices
its devices hold, nothing gathered (a program that ``exports_where_held``, every language-model
one); any other program's state is copied to every process and process 0 exports it."""

from __future__ import annotations

from pathlib import Path

from ..state import export
from ..state.arrays import STATE_HASH_VERSION
from ..supervision import distributed
from .events import EventLog
from .result import Ending, Progress
from .update_loop import HostSnapshot, evaluation


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

    together = group.size > 1 and program.exports_where_held
    if group.size > 1 and not together:
        # one host copy on every process (a collective when sharded over processes), so
        # that process 0 alone can export it afterwards
        state = jax.tree_util.tree_map(to_host, state)
    evaluation(program, state, step, events, final=True, keep=progress.metrics)
    if together:  # a collective: the processes write their slices, process 0 commits
        export.write_whole(
            export_dir, lambda partial: program.export(state, partial, group=group), group
        )
    elif group.is_writer:
        export.write_whole(export_dir, lambda partial: program.export(state, partial))
    progress.final_state_hash = snapshot.hash_of(state, step)
    progress.state_hash_version = STATE_HASH_VERSION
    return Ending.completed()
