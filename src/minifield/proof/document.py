"""The proof document (``proof.json``): its format, its modes, and the settings its runs
use, which the verdict checks again.

A qualification is the recipe's own computation truncated to ``steps`` updates
(``--stop-after-step``: an operational limit, not part of the computation digest), with
one or both interruptions (``mode``) after update ``k``.
"""

from __future__ import annotations

from ..supervision import supervise as supervisor

FORMAT = "minifield-proof/1"
PROOF_FILE = "proof.json"
MODES = ("crash", "preempt", "both")
DEFAULT_MODE = "both"
#: a proof written before the preemption mode existed proved a crash only
LEGACY_MODE = "crash"
#: seconds the preempted run's worker holds still after update k: the supervisor's SIGTERM
#: (sent within a poll interval of seeing that update's event) must land before update k+1
PREEMPT_HOLD_S = 3.0
#: the state-hash cadence of the proof's runs: every update, since every update after the
#: restored checkpoint is compared (the verdict refuses a proof recorded at another one)
PROOF_HASH_EVERY = 1
#: the worker's exit codes the proof relies on (0 completed, 1 failed, 2 invalid, 3 preempted,
#: 4 limit)
EXIT_FAILED, EXIT_PREEMPTED = 1, supervisor.WORKER_PREEMPTED


def parts(mode: str) -> tuple[str, ...]:
    """The interruptions a mode proves recovery from, in the order they run."""
    return {"crash": ("crash",), "preempt": ("preempt",), "both": ("crash", "preempt")}[mode]
