"""``minifield supervise --run-dir DIR --deadline-s D --stall-s S [--grace-s G] -- COMMAND ...``.

Runs COMMAND (an argument list, never a shell string) under the supervisor,
writes ``DIR/run.json`` and exits 0 only when the child completed; otherwise
1 failed, 3 preempted, 4 timeout, 5 stalled, 6 cancelled (2: bad usage).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from ..supervision import supervise as supervisor
from . import add_supervision_arguments, supervision_settings


def run(args) -> int:
    command = list(args.child)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        print("minifield supervise: no command given after '--'", file=sys.stderr)
        return 2
    settings = supervision_settings("supervise", args)
    if settings is None:
        return 2
    outcome = supervisor.supervise(
        command, args.run_dir, settings, preempt_after_step=args.preempt_after_step
    )
    summary = {
        k: outcome.get(k)
        for k in ("classification", "reason", "exit_code", "signal", "events_total", "duration_s")
    }
    summary["malformed_lines"] = len(outcome.get("malformed_lines", []))
    summary["run_json"] = str(Path(args.run_dir) / supervisor.RUN_FILE)
    print(json.dumps(summary, indent=2))
    return supervisor.exit_code_for(outcome)


def register(sub) -> None:
    parser = sub.add_parser(
        "supervise",
        help="run a worker command with a deadline, a stall timeout and signal forwarding",
        description=__doc__,
    )
    parser.add_argument("--run-dir", type=Path, required=True, help="where run.json and logs go")
    add_supervision_arguments(parser)
    parser.add_argument(
        "--preempt-after-step",
        type=int,
        metavar="K",
        help="send SIGTERM to the child once it reports update K (a preemption on cue)",
    )
    parser.add_argument("child", nargs="+", metavar="-- COMMAND ...", help="the command to run")
    parser.set_defaults(func=run)
