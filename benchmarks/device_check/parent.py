"""The check's parent process: runs each section in a process of its own, one after another
(one device), within its limit and the overall budget, and keeps the JSON up to date.

Only a worker opens the accelerator (``minifield.supervision.accelerator``): this process
keeps off it (``keep_off`` before anything here could start JAX), so its JAX, were it to start
one, runs on the CPU and never holds the chip a section's process needs. The sections that
measure the device are started with ``worker_env`` (the platforms this process was given);
the recovery section is a prover and keeps off too: its workers get the chip through the
supervisor, which starts them with ``worker_env``.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

from device_check.common import log, write_json
from device_check.processes import INTERRUPTED, run_section
from device_check.settings import (
    BUDGET_S,
    FORMAT,
    JOBS_ORDER,
    MIN_SECTION_S,
    NOT_APPLICABLE,
    REPO,
    SECTION_LIMIT_S,
    TINY_BUDGET_S,
    expected_backend,
)
from device_check.summary import summary

#: the sections whose process keeps off the accelerator (it starts workers that open it)
KEEPS_OFF = frozenset({"recovery"})


def child_env(section: str, environ=None) -> dict:
    """The environment of section ``section``'s process: ``worker_env`` (the accelerator's
    platforms) for a section that measures the device, this process's own (the CPU) for one
    that keeps off; ``determinism_cost`` without the GPU determinism flags."""
    from minifield.supervision import accelerator

    environ = os.environ if environ is None else environ
    env = dict(environ) if section in KEEPS_OFF else accelerator.worker_env(environ)
    env["PYTHONUNBUFFERED"] = "1"
    if section == "determinism_cost":
        flags = [f for f in env.get("XLA_FLAGS", "").split() if "deterministic_ops" not in f]
        env["XLA_FLAGS"] = " ".join(flags)
    return env


class Check:
    """One run of the check: its JSON (``out``), rewritten after every change."""

    def __init__(self, args) -> None:
        self.args = args
        self.budget = args.budget_s or (TINY_BUDGET_S if args.tiny else BUDGET_S)
        self.deadline = time.monotonic() + self.budget
        self.out_path = Path(args.out)
        # sections may run side by side (--jobs): one writer at a time
        self.lock = threading.RLock()
        self.out = {
            "format": FORMAT,
            "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "command": [sys.executable, *sys.argv],
            "tiny": args.tiny,
            "budget_s": self.budget,
            "settings": {
                "attention": args.attention,
                "scan_layers": args.scan_layers,
                "remat": args.remat,
                "grad_accum_steps": args.grad_accum_steps,
                "loss_chunk_tokens": args.loss_chunk_tokens,
                "rounds": args.rounds,
                "steps_per_round": args.steps_per_round,
                "proof_mode": args.proof_mode,
            },
            "sections": {},
            "summary": None,
        }

    def save(self) -> None:
        with self.lock:
            self.out["elapsed_s"] = self.budget - (self.deadline - time.monotonic())
            write_json(self.out_path, self.out)

    def record(self, name: str, result: dict) -> None:
        with self.lock:
            self.out["sections"][name] = result
            self.save()

    def _not_run(self, name: str, remaining: float) -> dict | None:
        """Why section ``name`` is not run (its result), or None."""
        device = self.out["sections"].get("device")
        if INTERRUPTED.is_set():
            return {"status": "skipped", "error": "the check was interrupted"}
        if name != "device" and device is not None and device.get("status") != "ok":
            return {"status": "skipped", "error": "the device section did not pass"}
        if name == "determinism_cost" and expected_backend(self.args) != "gpu":
            return {"status": NOT_APPLICABLE, "reason": "the flags apply to GPUs only"}
        if remaining < MIN_SECTION_S:
            return {"status": "skipped", "error": f"only {remaining:.0f} s of the budget left"}
        return None

    def run_one(self, name: str) -> None:
        args = self.args
        with self.lock:
            remaining = self.deadline - time.monotonic()
            result = self._not_run(name, remaining)
            if result is None:
                limit = args.section_limit.get(
                    name, SECTION_LIMIT_S[name] * (2 if args.tiny else 1)
                )
                limit = min(limit, remaining)
                log(f"section {name}: started (limit {limit:.0f} s)")
                self.record(name, {"status": "running"})
                context_path = Path(args.work_dir) / f"context-{name}.json"
                context_path.write_text(json.dumps(self.out["sections"]))
        if result is None:
            env = child_env(name)
            result = run_section(args, name, limit, context_path, self.record, env)
        self.record(name, result)
        why = result.get("error") or result.get("reason")
        log(f"section {name}: {result['status']}" + (f" ({why})" if why else ""))

    def run_all(self) -> None:
        """The device section first (the others need its verdict and measured peak); the rest
        one after another on an accelerator, or side by side with --jobs on a CPU (never on
        an accelerator: the sections would share the device and its memory)."""
        args = self.args
        for name in args.sections:
            self.out["sections"][name] = {"status": "pending"}
        rest = [name for name in args.sections if name != "device"]
        if "device" in args.sections:
            self.run_one("device")
        jobs = args.jobs
        device = self.out["sections"].get("device") or {}
        if jobs > 1 and device.get("backend", expected_backend(args)) != "cpu":
            log("--jobs ignored: sections share one accelerator, so they run one at a time")
            jobs = 1
        if jobs > 1:
            with concurrent.futures.ThreadPoolExecutor(jobs) as pool:
                # longest first, so the pool's last section is a short one
                order = sorted(rest, key=JOBS_ORDER.index)
                for future in [pool.submit(self.run_one, n) for n in order]:
                    future.result()
        else:
            for name in rest:
                self.run_one(name)


def run_parent(args) -> int:
    own_work_dir = args.work_dir is None
    if own_work_dir:
        (REPO / "work").mkdir(exist_ok=True)
        args.work_dir = tempfile.mkdtemp(prefix="device-check-", dir=REPO / "work")
    args.work_dir = str(Path(args.work_dir).resolve())
    Path(args.work_dir).mkdir(parents=True, exist_ok=True)
    check = Check(args)
    # SIGINT/SIGTERM: stop the running section(s) and their workers, skip the rest, and still
    # write the JSON (sections run in sessions of their own, so the signal reaches only us)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: INTERRUPTED.set())
    log(f"writing {check.out_path}; budget {check.budget:.0f} s; work in {args.work_dir}")
    check.run_all()
    out = check.out
    out["summary"] = summary(out["sections"], args.tiny)
    out["finished"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    check.save()
    if own_work_dir and not args.keep_work:
        shutil.rmtree(args.work_dir, ignore_errors=True)
    ok = len(out["summary"]["sections_ok"])
    log(f"done: {check.out_path} ({ok}/{len(args.sections)} sections ok)")
    return 0 if not out["summary"]["sections_not_ok"] else 1
