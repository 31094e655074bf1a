"""The ``recovery`` section: the recovery proof (``prove``: real workers under the supervisor)
of a small Llama recipe on this device, judged by ``verdict``.

This section's own process is a prover, so it keeps off the accelerator
(:func:`minifield.supervision.accelerator.keep_off`; the parent starts it without
``worker_env``): the workers the supervisor starts get the chip, one at a time. Its checks of
checkpoints and hashes run on the CPU."""

from __future__ import annotations

import json
import time
from pathlib import Path

from device_check.common import log
from device_check.settings import REPO, recovery_recipe


def run(args, context, report) -> dict:
    from minifield.supervision import accelerator

    accelerator.keep_off()  # before anything here could start JAX
    from minifield import recipe as recipes
    from minifield.proof.prove import prove
    from minifield.proof.verdict import verdict
    from minifield.supervision import supervise as supervisor

    work = Path(args.work_dir) / "recovery"
    recipe_path = work / "recipe.json"
    work.mkdir(parents=True, exist_ok=True)
    recipe_path.write_text(json.dumps(recovery_recipe(args), indent=2))
    checked = recipes.load(recipe_path)
    limit = max(args.deadline - time.time(), 10.0)
    # Every worker is bounded by what is left of the section. The grace from SIGTERM to
    # SIGKILL is the pipeline's (config train.grace_seconds): on the chip (2026-12-06) the
    # preempted worker committed its checkpoint and wrote its receipt, then was still letting
    # go of the TPU runtime 5 s later and was killed (exit -9), which fails the proof.
    grace = supervisor.Settings().grace_s
    supervision = supervisor.Settings(deadline_s=limit, stall_s=limit, grace_s=min(grace, limit))
    log(f"  recovery proof ({args.proof_mode}) of {checked.computation_digest[:16]}")
    proof = prove(
        recipe_path, REPO / "data", work, work / "proof.json",
        mode=args.proof_mode, supervision=supervision,
    )  # fmt: skip
    reasons = verdict(proof, checked.computation_digest)
    reference = {h["step"]: h["state_hash"] for h in proof["reference"]["state_hashes"]}
    out = {
        "recipe": {k: checked.data[k] for k in ("model", "training", "checkpoint", "runtime")},
        "computation_digest": checked.computation_digest,
        "mode": args.proof_mode,
        "steps": proof["settings"]["steps"],
        "fail_after_step": proof["settings"]["fail_after_step"],
        "passed": proof["passed"],
        "verdict_reasons": reasons,
        "bit_exact": proof["passed"] and not reasons,
        "diagnosis": proof["diagnosis"],
        "seconds": proof["seconds"],
        "reference_state_hashes": reference,
        "proof": str(work / "proof.json"),
    }
    for part in ("reference", "faulted", "resumed"):
        record = proof.get(part) or {}
        out[f"{part}_attempt_dir"] = record.get("attempt_dir")
    if proof.get("reference"):
        attempt = json.loads((Path(out["reference_attempt_dir"]) / "attempt.json").read_text())
        env = attempt["environment"]
        out["environment"] = {k: env.get(k) for k in ("backend", "device_kind", "xla_flags")}
    if proof.get("resumed"):  # no hashes where the proof stopped at a problem (its diagnosis)
        hashes = proof["resumed"].get("state_hashes") or []
        resumed = {h["step"]: h["state_hash"] for h in hashes}
        out["resumed_state_hashes"] = resumed
        out["checkpoint_step"] = (proof.get("checkpoint_used") or {}).get("step")
        out["steps_compared"] = sorted(s for s in resumed if s in reference)
    if proof.get("preempted"):
        out["preempted_passed"] = proof["preempted"].get("passed")
    return out
