"""Live delivery while a worker trains: a follower process beside it.

The supervisor starts ``python -m minifield.tracking.live`` next to the training worker
(:class:`LiveDelivery`). The follower tails the attempt's ``events.jsonl`` — the worker's
own durable record, so nothing is queued in the supervisor or the worker, and the backlog
is bounded only by the file — and delivers it batch by batch with the exactly-once cursor.
Training cannot be slowed or failed by it: it is a separate process at a lower CPU priority,
the worker never waits for it, and every error of the follower stays in its log. When the
server is slow or absent, delivery lags (retrying with backoff) and catches up later: when
the worker has ended the follower drains for at most ``drain_s`` seconds and is then
stopped; whatever is left is delivered by the next delivery of the computation (the
pipeline's ``deliver`` rule), from the cursor.

The follower learns that the worker has ended when its stdin closes (the supervisor closes
it, or the supervisor died), and stops retrying on SIGTERM.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import resource
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from .settings import TrackingSettings

DRAIN_S = 30.0
#: how often the follower looks for new events: one request per second at most while
#: training, whatever the update rate (fewer, larger batches cost the machine less)
POLL_S = 1.0


class LiveDelivery:
    """The supervisor's side: start the follower, tell it the worker ended, reap it."""

    def __init__(
        self,
        settings: TrackingSettings,
        attempt_dir: Path,
        *,
        recipe_json: Path | None = None,
        log_path: Path | None = None,
        drain_s: float = DRAIN_S,
    ):
        self.settings = settings
        self.attempt_dir = Path(attempt_dir)
        self.recipe_json = recipe_json
        self.log_path = log_path
        self.drain_s = drain_s
        self.process: subprocess.Popen | None = None
        self.error: str | None = None

    def command(self) -> list[str]:
        command = [
            sys.executable,
            "-m",
            "minifield.tracking.live",
            "--settings",
            json.dumps(_settings_json(self.settings)),
            "--attempt-dir",
            str(self.attempt_dir),
        ]
        if self.recipe_json is not None:
            command += ["--recipe", str(self.recipe_json)]
        return command

    def start(self) -> None:
        """Start the follower; a failure to start is recorded, never raised."""
        try:
            log = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL
            try:
                self.process = subprocess.Popen(
                    self.command(),
                    stdin=subprocess.PIPE,
                    stdout=log,
                    stderr=log,
                    start_new_session=True,  # signals meant for training do not reach it
                )
            finally:
                if self.log_path:
                    log.close()
        except OSError as exc:
            self.error = f"could not start live delivery: {exc}"

    def finish(self) -> dict[str, Any]:
        """The worker has ended: let the follower drain (bounded), then stop it. Never raises."""
        if self.process is None:
            return {"started": False, "error": self.error}
        started = time.monotonic()
        # CPU the follower used: what the children reaped during this call consumed (the
        # worker was reaped before), the figure that bounds its cost to training
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        try:
            self.process.stdin.close()
        except OSError:
            pass
        stopped_by = None
        try:
            code = self.process.wait(timeout=self.drain_s)
        except subprocess.TimeoutExpired:
            stopped_by = "SIGTERM"
            self.process.send_signal(signal.SIGTERM)
            try:
                code = self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                stopped_by = "SIGKILL"
                self.process.kill()
                code = self.process.wait()
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu_s = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
        return {
            "started": True,
            "cpu_s": cpu_s,
            "pid": self.process.pid,
            "exit_code": code,
            "stopped_by": stopped_by,
            "drain_s": time.monotonic() - started,
            "log": str(self.log_path) if self.log_path else None,
        }


def _settings_json(settings: TrackingSettings) -> dict:
    return {
        key: (str(value) if isinstance(value, Path) else value)
        for key, value in dataclasses.asdict(settings).items()
    }


def _settings_from_json(document: dict) -> TrackingSettings:
    paths = {"credentials", "ca_bundle", "state_dir"}
    return TrackingSettings(
        **{k: (Path(v) if k in paths and v is not None else v) for k, v in document.items()}
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="minifield.tracking.live")
    parser.add_argument("--settings", required=True)
    parser.add_argument("--attempt-dir", type=Path, required=True)
    parser.add_argument("--recipe", type=Path)
    args = parser.parse_args(argv)
    try:
        os.nice(19)  # training comes first on a shared machine
    except OSError:
        pass
    ended, stop = threading.Event(), threading.Event()

    def watch_stdin() -> None:
        # Raw reads of descriptor 0, not sys.stdin: a daemon thread blocked inside a buffered
        # reader's lock aborts the interpreter at exit (when delivery finished first).
        try:
            while os.read(0, 4096):
                pass
        except OSError:
            pass
        ended.set()  # EOF: the supervisor closed it, or went away

    threading.Thread(target=watch_stdin, daemon=True).start()
    signal.signal(signal.SIGTERM, lambda *_: (stop.set(), ended.set()))
    from . import connection
    from .delivery import Delivery
    from .runs import recipe_params

    settings = _settings_from_json(json.loads(args.settings))
    try:
        link = connection.Connection(settings)
        link.stop_retrying_on(stop)
        params = None
        if args.recipe is not None and args.recipe.is_file():
            from .. import atomic

            params = recipe_params(atomic.read_json(args.recipe))
        cursor = Delivery(link).deliver_attempt(
            args.attempt_dir,
            params=params,
            follow=ended,
            poll_s=POLL_S,
            on_batch=lambda c: print(
                f"live delivery: delivered up to seq {c.delivered_seq}", flush=True
            ),
        )
    except Exception as exc:  # one line in the follower's log; training is not concerned
        print(f"live delivery of {args.attempt_dir}: stopped: {exc}", flush=True)
        return 1
    print(
        f"live delivery of {args.attempt_dir}: up to seq {cursor.delivered_seq}"
        + (" (attempt finished)" if cursor.finished else ""),
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
