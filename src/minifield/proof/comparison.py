"""Each resumed run compared with the reference: the restored state, the next update and
every later complete-state hash. The first divergence names the step and the state part(s)
that differ; :func:`divergence_text` says what that means.

A plausible final loss is not evidence; equal complete-state hashes are.
"""

from __future__ import annotations

from pathlib import Path

from .. import atomic
from ..attempt.layout import CHECKPOINTS
from .runs import Runs


def _manifest_part_diff(a: Path, b: Path) -> list[str] | None:
    """State parts whose arrays differ between two checkpoint manifests, by the per-array
    hash both record (``digest``: formats 4 and 5; ``sha256``: formats 2 and 3); None when
    they record none in common (a format-3 and a format-5 checkpoint)."""
    from ..state import checkpoint

    ma, mb = atomic.read_json(a / checkpoint.MANIFEST), atomic.read_json(b / checkpoint.MANIFEST)
    for key in ("digest", "sha256"):
        if all(key in e for e in ma["arrays"] + mb["arrays"]):
            sa = {e["name"]: e[key] for e in ma["arrays"]}
            sb = {e["name"]: e[key] for e in mb["arrays"]}
            return sorted({n.split("/", 1)[0] for n in set(sa) | set(sb) if sa.get(n) != sb.get(n)})
    return None


def compare(
    reference: dict[int, dict],
    resumed: dict[int, dict],
    *,
    restored_step: int,
    restored_state_hash: str | None,
    steps: int,
) -> dict:
    """Compare the restored state and every resumed update with the reference.

    ``reference``/``resumed`` map step → update event (with ``state_hash`` and
    ``part_hashes``). Returns the comparison rows, the next-update comparison and
    the first divergence (or None).
    """
    rows = []
    divergence = None
    if restored_step > 0:
        ref = reference.get(restored_step, {})
        equal = restored_state_hash is not None and restored_state_hash == ref.get("state_hash")
        rows.append(
            {
                "step": restored_step,
                "what": "restored checkpoint",
                "reference": ref.get("state_hash"),
                "resumed": restored_state_hash,
                "equal": equal,
            }
        )
        if not equal:
            divergence = {
                "step": restored_step,
                "what": "restored checkpoint",
                "parts": None,  # filled from the checkpoint manifests by the caller
                "reference_state_hash": ref.get("state_hash"),
                "resumed_state_hash": restored_state_hash,
            }
    next_update = None
    for step in range(restored_step + 1, steps + 1):
        ref, res = reference.get(step), resumed.get(step)
        row = {
            "step": step,
            "what": "update",
            "reference": ref.get("state_hash") if ref else None,
            "resumed": res.get("state_hash") if res else None,
        }
        row["equal"] = bool(ref and res and row["reference"] and row["reference"] == row["resumed"])
        rows.append(row)
        if step == restored_step + 1:
            next_update = {
                **row,
                "reference_loss": ref.get("loss") if ref else None,
                "resumed_loss": res.get("loss") if res else None,
            }
        if not row["equal"] and divergence is None:
            if ref is None or res is None:
                parts = None
                missing = "reference" if ref is None else "resumed run"
            else:
                rp, sp = ref.get("part_hashes") or {}, res.get("part_hashes") or {}
                parts = sorted(p for p in set(rp) | set(sp) if rp.get(p) != sp.get(p))
                missing = None
            divergence = {
                "step": step,
                "what": "update",
                "parts": parts,
                "missing_in": missing,
                "reference_state_hash": row["reference"],
                "resumed_state_hash": row["resumed"],
            }
    return {"rows": rows, "next_update": next_update, "first_divergence": divergence}


def compare_with_reference(
    runs: Runs,
    section: dict,
    reference: dict[int, dict],
    resumed: dict[int, dict],
    checkpoint_used: dict,
) -> bool:
    """Compare a resumed run with the reference into ``section``; True when all equal."""
    from ..state import checkpoint

    restored = section["resumed"]["restored"]
    start = checkpoint_used["step"]
    result = compare(
        reference,
        resumed,
        restored_step=start,
        restored_state_hash=restored.get("state_hash"),
        steps=runs.steps,
    )
    div = result["first_divergence"]
    if div is not None and div["what"] == "restored checkpoint":
        ref_ckpt = runs.job_dir / "reference" / CHECKPOINTS / checkpoint.step_dir_name(start)
        if (ref_ckpt / checkpoint.MANIFEST).is_file():
            div["parts"] = _manifest_part_diff(ref_ckpt, Path(checkpoint_used["path"]))
    section["comparison"] = result["rows"]
    section["next_update"] = result["next_update"]
    section["first_divergence"] = div
    return (
        div is None
        and section["resumed"]["steps_completed"] == runs.steps
        and all(row["equal"] for row in result["rows"])
        and len(result["rows"]) >= runs.steps - start
    )


_PART_HINTS = {
    "params": "parameters differ: the update computation is not reproducible after a restore",
    "opt_state": "optimizer state differs: it is not fully saved or restored",
    "rng": "the random key differs: the RNG state is not part of the checkpoint or is advanced differently",
    "cursor": "the data cursor differs: data order is not a pure function of the saved state",
    "step": "the step counter differs",
    "frozen_base": "the frozen base model's identity differs (LoRA): another base was loaded",
}


def divergence_text(div: dict, after: str) -> str:
    """What a first divergence means, in words; ``after`` names the interruption."""
    parts = ", ".join(div.get("parts") or []) or "unknown part"
    if div.get("missing_in"):
        return (
            f"After the {after}, step {div['step']} is missing in the {div['missing_in']}: the "
            "runs cannot be compared there (see its run.json and logs)."
        )
    if div["what"] == "restored checkpoint":
        return (
            f"After the {after}, the state restored from the checkpoint at step {div['step']} "
            f"differs from the reference at that step (differing part(s): {parts}): the "
            "checkpoint does not hold the complete state it claims, or the reference is not "
            "reproducible."
        )
    why = "; ".join(_PART_HINTS.get(p, p + " differs") for p in (div.get("parts") or []))
    return (
        f"After the {after}, the resumed run diverged from the reference at step {div['step']} "
        f"(first differing part(s): {parts}) — {why}. A resumed training would not be the same "
        "computation; training is blocked until this is fixed."
    )
