"""The verdict: the one judgement of a proof document, used by the training gate, the
store's publication and its activation.

It recomputes the comparison from the hashes the document records and trusts neither
``passed`` nor ``first_divergence``; each refusal reason is one sentence naming the part
(crash or preempt) and what is wrong.
"""

from __future__ import annotations

import os

from .document import EXIT_PREEMPTED, FORMAT, LEGACY_MODE, MODES, PROOF_HASH_EVERY, parts


def _obj(value: object) -> dict:
    return value if isinstance(value, dict) else {}


def _is_step(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _hash_map(value: object) -> dict[int, str] | None:
    """``[{step, state_hash}]`` as step → hash, or None when it is not such a list."""
    if not isinstance(value, list):
        return None
    out = {}
    for row in value:
        if not isinstance(row, dict) or not _is_step(row.get("step")):
            return None
        out[row["step"]] = row.get("state_hash")
    return out


def _same_path(a: object, b: object) -> bool:
    return isinstance(a, str) and isinstance(b, str) and os.path.normpath(a) == os.path.normpath(b)


def _steps_text(steps: list[int]) -> str:
    return ", ".join(map(str, steps[:10])) + (f" and {len(steps) - 10} more" if steps[10:] else "")


def _version_mix(part: str, proof: dict, resumed: dict, restored: dict, used: dict) -> str | None:
    """Why the proof's state hashes cannot be compared: they are of different versions
    (``state.arrays.STATE_HASH_VERSION``; a record without one predates the versions: 1)."""
    versions = {
        "the reference": _obj(proof.get("reference")).get("state_hash_version", 1),
        "the resumed run": resumed.get("state_hash_version", 1),
        "its restored checkpoint": restored.get("state_hash_version", 1),
        "the checkpoint used": used.get("state_hash_version", 1),
    }
    known = {name: version for name, version in versions.items() if version is not None}
    if len(set(known.values())) <= 1:
        return None
    listed = ", ".join(f"{name} {version}" for name, version in known.items())
    return (
        f"{part}: the state hashes are of different versions ({listed}): hashes of two "
        f"versions never agree, so this proof compares nothing; prove again with one "
        f"minifield version"
    )


def _resumed_reasons(
    part: str,
    proof: dict,
    reference: dict[int, str] | None,
    resumed_record: object,
    used: dict,
    rows: object,
    steps: int,
) -> list[str]:
    """A resumed run against the reference, from the hashes both records hold."""
    reasons = []
    resumed, restored = _obj(resumed_record), _obj(_obj(resumed_record).get("restored"))
    start = restored.get("step")
    if not _is_step(start):
        return [f"{part}: the resumed run records no restored checkpoint"]
    if used.get("verified") is not True:
        reasons.append(f"{part}: the checkpoint used is not recorded as verified")
    if (
        start != used.get("step")
        or not restored.get("sha256")
        or (restored.get("sha256") != used.get("sha256"))
    ):
        reasons.append(
            f"{part}: the resumed run restored the checkpoint of step {start} (sha256 "
            f"{restored.get('sha256')}), not the verified one of step {used.get('step')} "
            f"(sha256 {used.get('sha256')})"
        )
    mix = _version_mix(part, proof, resumed, restored, used)
    if mix is not None:
        return [*reasons, mix]
    hashes = _hash_map(resumed.get("state_hashes"))
    if hashes is None:
        return [*reasons, f"{part}: the resumed run's state_hashes are missing or malformed"]
    if start >= steps:
        reasons.append(f"{part}: the restored step {start} leaves no update up to steps={steps}")
    elif not hashes.get(start + 1):
        reasons.append(
            f"{part}: the resumed run records no update {start + 1}, the step right after the "
            f"restored checkpoint (step {start})"
        )
    if reference is not None:
        if start > 0 and (
            not restored.get("state_hash") or restored.get("state_hash") != reference.get(start)
        ):
            reasons.append(
                f"{part}: the restored state hash {restored.get('state_hash')} differs from the "
                f"reference's at step {start} ({reference.get(start)})"
            )
        differ = [s for s in range(start + 1, steps + 1) if hashes.get(s) != reference.get(s)]
        if differ:
            reasons.append(
                f"{part}: the resumed run's state hash differs from the reference's (or is "
                f"missing) at step(s) {_steps_text(differ)}"
            )
    # the recorded comparison, judged by its own hashes (its ``equal`` flags are not read)
    if not isinstance(rows, list) or not rows:
        return [*reasons, f"{part}: the proof records no comparison"]
    unequal, covered, unhashed = [], set(), []
    for row in rows:
        row = _obj(row)
        step = row.get("step") if _is_step(row.get("step")) else -1
        covered.add(step)
        if not row.get("reference") or not row.get("resumed"):
            unhashed.append(step)
        agrees = reference is None or reference.get(step) == row.get("reference")
        if not row.get("reference") or row.get("reference") != row.get("resumed") or not agrees:
            unequal.append(step)
    if unhashed:
        reasons.append(
            f"{part}: the recorded comparison claims step(s) {_steps_text(unhashed)}, where the "
            f"reference or the resumed run recorded no state hash"
        )
    if unequal:
        reasons.append(
            f"{part}: the recorded comparison is not equal (or not the reference's hash) at "
            f"step(s) {_steps_text(unequal)}"
        )
    uncovered = [s for s in range(start + 1, steps + 1) if s not in covered]
    if uncovered:
        reasons.append(f"{part}: the recorded comparison omits step(s) {_steps_text(uncovered)}")
    return reasons


def _crash_reasons(proof: dict, reference: dict[int, str] | None, steps: int) -> list[str]:
    reasons = []
    k = _obj(proof.get("settings")).get("fail_after_step")
    faulted, used = _obj(proof.get("faulted")), _obj(proof.get("checkpoint_used"))
    if faulted.get("classification") != "failed" or faulted.get("last_update_step") != k:
        reasons.append(
            f"crash: the faulted run is not the injected crash after update {k} "
            f"(classification {faulted.get('classification')!r}, last update "
            f"{faulted.get('last_update_step')!r})"
        )
    if not _is_step(used.get("step")) or not _is_step(k) or used["step"] > k:
        reasons.append(f"crash: the checkpoint used ({used.get('step')!r}) is not at or before {k}")
    reasons += _resumed_reasons(
        "crash", proof, reference, proof.get("resumed"), used, proof.get("comparison"), steps
    )
    if proof.get("first_divergence") is not None:
        reasons.append(f"crash: the proof records a divergence: {proof['first_divergence']!r}")
    return reasons


def _preempt_reasons(proof: dict, reference: dict[int, str] | None, steps: int) -> list[str]:
    section = proof.get("preempted")
    if not isinstance(section, dict):
        return ["preempt: the proof's mode includes a preemption, but it has no preempted section"]
    reasons = []
    k = _obj(proof.get("settings")).get("preempt_after_step")
    run, receipt = _obj(section.get("run")), _obj(section.get("receipt"))
    used = _obj(section.get("checkpoint_used"))
    if run.get("classification") != "preempted" or run.get("exit_code") != EXIT_PREEMPTED:
        reasons.append(
            f"preempt: the preempted run did not exit {EXIT_PREEMPTED} as preempted "
            f"(classification {run.get('classification')!r}, exit {run.get('exit_code')!r})"
        )
    if not _is_step(k) or receipt.get("step") != k:
        reasons.append(
            f"preempt: the receipt names the checkpoint of step {receipt.get('step')!r}, not the "
            f"step {k!r} the preemption came after"
        )
    restored = _obj(_obj(section.get("resumed")).get("restored"))
    for name, record in (
        ("checkpoint used", used),
        ("resumed run's restored checkpoint", restored),
    ):
        if (
            not receipt.get("sha256")
            or record.get("step") != receipt.get("step")
            or record.get("sha256") != receipt.get("sha256")
            or not _same_path(record.get("path"), receipt.get("path"))
        ):
            reasons.append(
                f"preempt: the {name} ({record.get('path')}, sha256 {record.get('sha256')}) is "
                f"not the one the receipt names ({receipt.get('path')}, sha256 "
                f"{receipt.get('sha256')})"
            )
    reasons += _resumed_reasons(
        "preempt", proof, reference, section.get("resumed"), used, section.get("comparison"), steps
    )
    if section.get("first_divergence") is not None:
        reasons.append(f"preempt: the proof records a divergence: {section['first_divergence']!r}")
    if section.get("passed") is not True:
        reasons.append(f"preempt: the section does not say it passed ({section.get('passed')!r})")
    return reasons


def verdict(proof: object, computation_digest: str | None) -> list[str]:
    """Why ``proof`` is not acceptable evidence for ``computation_digest`` (empty: accepted).

    The one judgement of a proof document (training gate, publication, activation). It
    reads the document alone and recomputes every comparison from the state hashes it
    records: the reference's against each resumed run's, step by step from the restored
    checkpoint, and each recorded comparison row from its own two hashes. ``passed`` must
    agree with all of that; ``first_divergence`` and ``equal`` flags are not trusted, and a
    ``status`` field means nothing. A proof without ``settings.mode`` predates the
    preemption mode and is judged as a crash-only proof.
    """
    if not isinstance(proof, dict):
        return [f"the proof is not a JSON object (it is a {type(proof).__name__})"]
    if proof.get("format") != FORMAT:
        return [f"the document is not a recovery proof of format {FORMAT} "
                f"(format {proof.get('format')!r})"]  # fmt: skip
    reasons = []
    if proof.get("computation_digest") != computation_digest:
        reasons.append(
            f"the proof is of computation {proof.get('computation_digest')!r}, not "
            f"{computation_digest}"
        )
    settings = _obj(proof.get("settings"))
    mode, steps = settings.get("mode", LEGACY_MODE), settings.get("steps")
    if mode not in MODES or not _is_step(steps) or steps < 1:
        return [*reasons, f"the proof's settings are malformed (mode {mode!r}, steps {steps!r})"]
    # a proof from before the cadence existed hashed every update
    cadence = settings.get("state_hash_every", PROOF_HASH_EVERY)
    if cadence != PROOF_HASH_EVERY:
        reasons.append(
            f"the proof's runs recorded state hashes at cadence {cadence!r}, not after every "
            f"update: the updates between hashes are not compared"
        )
    reference = _hash_map(_obj(proof.get("reference")).get("state_hashes"))
    if reference is None:
        reasons.append("the reference run's state_hashes are missing or malformed")
    else:
        missing = [s for s in range(1, steps + 1) if not reference.get(s)]
        if missing:
            reasons.append(f"the reference records no state hash at step(s) {_steps_text(missing)}")
    if "crash" in parts(mode):
        reasons += _crash_reasons(proof, reference, steps)
    if "preempt" in parts(mode):
        reasons += _preempt_reasons(proof, reference, steps)
    if proof.get("problem") is not None:
        reasons.append(f"the proof records a problem: {proof['problem']}")
    if proof.get("passed") is not True:
        reasons.append(
            f"the proof does not say it passed (passed={proof.get('passed')!r}): "
            f"{proof.get('diagnosis')}"
        )
    elif reasons:
        reasons.append("it says passed: true, which its own records above contradict")
    return reasons
