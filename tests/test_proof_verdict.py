"""The proof verdict, one refusal reason at a time: a real proof with exactly one thing wrong.

Each case alters one field of a proof `minifield prove` wrote for the linear demo (both parts:
a crash after update 3 resumed from the checkpoint of step 2, a preemption after update 3
resumed from the checkpoint of step 3, six steps) and names, written out here by hand from
the proof's own values, every reason the verdict must give. These tests are fast and read
documents only; they are the tests the mutation run of the verdict uses
(docs/development.md). The slow test at the end runs the same table on the proof the demo pipeline
wrote in this test session.
"""

from __future__ import annotations

import ast
import copy
import inspect
import json
import textwrap
from collections.abc import Callable
from dataclasses import dataclass

import pytest
from conftest import REPO

from minifield.proof import document
from minifield.proof import verdict as verdicts

PROOF = REPO / "tests" / "data" / "proofs" / "linear-demo-both.json"
CONTRADICTION = "it says passed: true, which its own records above contradict"


def stored_proof() -> dict:
    return json.loads(PROOF.read_text())


def ref(proof: dict, step: int) -> str:
    """The reference's state hash at ``step``, read from the unaltered proof's raw record."""
    (row,) = [r for r in proof["reference"]["state_hashes"] if r["step"] == step]
    return row["state_hash"]


@dataclass(frozen=True)
class Alteration:
    name: str
    alter: Callable[[dict], None]  # changes exactly one field of the proof, in place
    expected: Callable[[dict], list[str]]  # every reason, from the unaltered proof's values


def _set(*path_and_value):
    *path, value = path_and_value

    def alter(proof: dict) -> None:
        parent = proof
        for key in path[:-1]:
            parent = parent[key]
        parent[path[-1]] = value

    return alter


def _drop_row(section: str | None, record: str, step: int):
    def alter(proof: dict) -> None:
        part = proof if section is None else proof[section]
        holder = part[record] if record != "comparison" else part
        key = "state_hashes" if record != "comparison" else "comparison"
        holder[key] = [r for r in holder[key] if r["step"] != step]

    return alter


def _restored_not_used(part, start, used_step, restored_sha, used_sha):
    return (
        f"{part}: the resumed run restored the checkpoint of step {start} (sha256 "
        f"{restored_sha}), not the verified one of step {used_step} (sha256 {used_sha})"
    )


def _unhashed(part: str, steps: str) -> str:
    return (
        f"{part}: the recorded comparison claims step(s) {steps}, where the reference or the "
        "resumed run recorded no state hash"
    )


def _unequal(part: str, steps: str) -> str:
    return f"{part}: the recorded comparison is not equal (or not the reference's hash) at step(s) {steps}"


def _differs(part: str, steps: str) -> str:
    return (
        f"{part}: the resumed run's state hash differs from the reference's (or is missing) at "
        f"step(s) {steps}"
    )


def _receipt_mismatch(name: str, record: dict, receipt: dict) -> str:
    return (
        f"preempt: the {name} ({record['path']}, sha256 {record['sha256']}) is not the one the "
        f"receipt names ({receipt['path']}, sha256 {receipt['sha256']})"
    )


def _version_mix(part: str, p: dict, *, resumed=None, restored=None) -> str:
    """The reason for hashes of two versions; a record without a version holds version 1."""
    section = p if part == "crash" else p["preempted"]
    run, used = section["resumed"], section["checkpoint_used"]
    versions = (
        p["reference"].get("state_hash_version", 1),
        resumed or run.get("state_hash_version", 1),
        restored or run["restored"].get("state_hash_version", 1),
        used.get("state_hash_version", 1),
    )
    return (
        f"{part}: the state hashes are of different versions (the reference {versions[0]}, "
        f"the resumed run {versions[1]}, its restored checkpoint {versions[2]}, the checkpoint "
        f"used {versions[3]}): hashes of two versions never agree, so this proof compares "
        f"nothing; prove again with one minifield version"
    )


def _crash_used(p):
    return p["checkpoint_used"]


def _pre(p):
    return p["preempted"]


ALTERATIONS = [
    # -- the document and its settings ---------------------------------------------------
    Alteration(
        "format",
        _set("format", "minifield-proof/0"),
        lambda p: [
            f"the document is not a recovery proof of format {document.FORMAT} "
            "(format 'minifield-proof/0')"
        ],
    ),
    Alteration(
        "another-computation",
        _set("computation_digest", "ab" * 32),
        lambda p: [
            f"the proof is of computation '{'ab' * 32}', not {p['computation_digest']}",
            CONTRADICTION,
        ],
    ),
    Alteration(
        "hashed-every-other-update",
        _set("settings", "state_hash_every", 2),
        lambda p: [
            "the proof's runs recorded state hashes at cadence 2, not after every update: the "
            "updates between hashes are not compared",
            CONTRADICTION,
        ],
    ),
    Alteration(
        "mode-unknown",
        _set("settings", "mode", "sometimes"),
        lambda p: ["the proof's settings are malformed (mode 'sometimes', steps 6)"],
    ),
    Alteration(
        "steps-zero",
        _set("settings", "steps", 0),
        lambda p: ["the proof's settings are malformed (mode 'both', steps 0)"],
    ),
    Alteration(
        "steps-negative",
        _set("settings", "steps", -1),
        lambda p: ["the proof's settings are malformed (mode 'both', steps -1)"],
    ),
    Alteration(
        "steps-beyond-the-records",
        _set("settings", "steps", 20),
        lambda p: [
            "the reference records no state hash at step(s) 7, 8, 9, 10, 11, 12, 13, 14, 15, "
            "16 and 4 more",
            "crash: the recorded comparison omits step(s) 7, 8, 9, 10, 11, 12, 13, 14, 15, 16 "
            "and 4 more",
            "preempt: the recorded comparison omits step(s) 7, 8, 9, 10, 11, 12, 13, 14, 15, 16 "
            "and 4 more",
            CONTRADICTION,
        ],
    ),
    Alteration(
        "steps-eleven-beyond-the-records",
        _set("settings", "steps", 17),
        lambda p: [
            "the reference records no state hash at step(s) 7, 8, 9, 10, 11, 12, 13, 14, 15, "
            "16 and 1 more",
            "crash: the recorded comparison omits step(s) 7, 8, 9, 10, 11, 12, 13, 14, 15, 16 "
            "and 1 more",
            "preempt: the recorded comparison omits step(s) 7, 8, 9, 10, 11, 12, 13, 14, 15, 16 "
            "and 1 more",
            CONTRADICTION,
        ],
    ),
    Alteration(
        "steps-one",
        # one step is a well-formed setting, but both parts restored past it
        _set("settings", "steps", 1),
        lambda p: [
            "crash: the restored step 2 leaves no update up to steps=1",
            "preempt: the restored step 3 leaves no update up to steps=1",
            CONTRADICTION,
        ],
    ),
    Alteration(
        "reference-omits-step-1",
        _drop_row(None, "reference", 1),
        lambda p: ["the reference records no state hash at step(s) 1", CONTRADICTION],
    ),
    Alteration(
        "reference-malformed",
        _set("reference", "state_hashes", {"1": "abc"}),
        lambda p: ["the reference run's state_hashes are missing or malformed", CONTRADICTION],
    ),
    Alteration(
        "reference-row-without-step",
        _set("reference", "state_hashes", 0, "step", None),
        lambda p: ["the reference run's state_hashes are missing or malformed", CONTRADICTION],
    ),
    Alteration(
        "reference-omits-step-5",
        _drop_row(None, "reference", 5),
        lambda p: [
            "the reference records no state hash at step(s) 5",
            _differs("crash", "5"),
            _unequal("crash", "5"),
            _differs("preempt", "5"),
            _unequal("preempt", "5"),
            CONTRADICTION,
        ],
    ),
    Alteration(
        "problem-recorded",
        _set("problem", "the disk filled up"),
        lambda p: ["the proof records a problem: the disk filled up", CONTRADICTION],
    ),
    Alteration(
        "problem-empty-string",
        _set("problem", ""),
        lambda p: ["the proof records a problem: ", CONTRADICTION],
    ),
    # -- the crash part ------------------------------------------------------------------
    Alteration(
        "faulted-not-failed",
        _set("faulted", "classification", "completed"),
        lambda p: [
            "crash: the faulted run is not the injected crash after update 3 (classification "
            "'completed', last update 3)",
            CONTRADICTION,
        ],
    ),
    Alteration(
        "faulted-after-another-update",
        _set("faulted", "last_update_step", 4),
        lambda p: [
            "crash: the faulted run is not the injected crash after update 3 (classification "
            "'failed', last update 4)",
            CONTRADICTION,
        ],
    ),
    Alteration(
        "checkpoint-used-after-k",
        _set("checkpoint_used", "step", 4),
        lambda p: [
            "crash: the checkpoint used (4) is not at or before 3",
            _restored_not_used("crash", 2, 4, _crash_used(p)["sha256"], _crash_used(p)["sha256"]),
            CONTRADICTION,
        ],
    ),
    Alteration(
        "checkpoint-used-without-step",
        _set("checkpoint_used", "step", "2"),
        lambda p: [
            "crash: the checkpoint used ('2') is not at or before 3",
            _restored_not_used("crash", 2, "2", _crash_used(p)["sha256"], _crash_used(p)["sha256"]),
            CONTRADICTION,
        ],
    ),
    Alteration(
        "checkpoint-used-not-verified",
        _set("checkpoint_used", "verified", "yes"),
        lambda p: ["crash: the checkpoint used is not recorded as verified", CONTRADICTION],
    ),
    Alteration(
        "restored-another-checkpoint",
        _set("resumed", "restored", "sha256", "2" * 64),
        lambda p: [
            _restored_not_used("crash", 2, 2, "2" * 64, _crash_used(p)["sha256"]),
            CONTRADICTION,
        ],
    ),
    Alteration(
        "restored-checkpoint-without-sha256",
        _set("resumed", "restored", "sha256", ""),
        lambda p: [
            _restored_not_used("crash", 2, 2, "", _crash_used(p)["sha256"]),
            CONTRADICTION,
        ],
    ),
    Alteration(
        "restored-state-hash-differs",
        _set("resumed", "restored", "state_hash", "3" * 64),
        lambda p: [
            f"crash: the restored state hash {'3' * 64} differs from the reference's at step 2 "
            f"({ref(p, 2)})",
            CONTRADICTION,
        ],
    ),
    Alteration(
        "restored-state-hash-missing",
        _set("resumed", "restored", "state_hash", None),
        lambda p: [
            f"crash: the restored state hash None differs from the reference's at step 2 "
            f"({ref(p, 2)})",
            CONTRADICTION,
        ],
    ),
    Alteration(
        "restored-step-at-the-end",
        _set("resumed", "restored", "step", 6),
        lambda p: [
            _restored_not_used("crash", 6, 2, _crash_used(p)["sha256"], _crash_used(p)["sha256"]),
            "crash: the restored step 6 leaves no update up to steps=6",
            f"crash: the restored state hash {ref(p, 2)} differs from the reference's at step "
            f"6 ({ref(p, 6)})",
            CONTRADICTION,
        ],
    ),
    Alteration(
        "resumed-hashes-malformed",
        _set("resumed", "state_hashes", None),
        lambda p: ["crash: the resumed run's state_hashes are missing or malformed", CONTRADICTION],
    ),
    Alteration(
        "resumed-hash-missing",
        _set("resumed", "state_hashes", 3, "state_hash", None),
        lambda p: [
            _differs("crash", "6"),
            CONTRADICTION,
        ],
    ),
    Alteration(
        "resumed-run-skips-the-next-update",
        _drop_row(None, "resumed", 3),
        lambda p: [
            "crash: the resumed run records no update 3, the step right after the restored "
            "checkpoint (step 2)",
            _differs("crash", "3"),
            CONTRADICTION,
        ],
    ),
    Alteration(
        "no-comparison",
        _set("comparison", []),
        lambda p: ["crash: the proof records no comparison", CONTRADICTION],
    ),
    Alteration(
        "comparison-omits-the-last-step",
        _drop_row(None, "comparison", 6),
        lambda p: ["crash: the recorded comparison omits step(s) 6", CONTRADICTION],
    ),
    Alteration(
        "comparison-omits-the-first-update",
        _drop_row(None, "comparison", 3),
        lambda p: ["crash: the recorded comparison omits step(s) 3", CONTRADICTION],
    ),
    Alteration(
        "comparison-row-of-another-hash",
        # both hashes of the row agree with each other, but not with the reference's record
        _set(
            "comparison",
            2,
            {**stored_proof()["comparison"][2]} | {"reference": "5" * 64, "resumed": "5" * 64},
        ),  # fmt: skip
        lambda p: [
            _unequal("crash", "4"),
            CONTRADICTION,
        ],
    ),
    Alteration(
        "comparison-row-without-hashes",
        _set("comparison", 1, {"step": 3, "what": "update", "equal": True}),
        lambda p: [
            _unhashed("crash", "3"),
            _unequal("crash", "3"),
            CONTRADICTION,
        ],
    ),
    Alteration(
        "comparison-row-without-the-resumed-hash",
        _set("comparison", 1, "resumed", None),
        lambda p: [
            _unhashed("crash", "3"),
            _unequal("crash", "3"),
            CONTRADICTION,
        ],
    ),
    Alteration(
        "comparison-row-of-no-step",
        # the row of step 4 now names no step: it covers nothing, and agrees with nothing
        _set("comparison", 2, "step", "4"),
        lambda p: [
            _unequal("crash", "-1"),
            "crash: the recorded comparison omits step(s) 4",
            CONTRADICTION,
        ],
    ),
    Alteration(
        "crash-divergence-recorded",
        _set("first_divergence", {"step": 4}),
        lambda p: ["crash: the proof records a divergence: {'step': 4}", CONTRADICTION],
    ),
    # -- the preemption part -------------------------------------------------------------
    Alteration(
        "no-preempted-section",
        _set("preempted", "none"),
        lambda p: [
            "preempt: the proof's mode includes a preemption, but it has no preempted section",
            CONTRADICTION,
        ],
    ),
    Alteration(
        "preempted-run-exit-0",
        _set("preempted", "run", "exit_code", 0),
        lambda p: [
            "preempt: the preempted run did not exit 3 as preempted (classification "
            "'preempted', exit 0)",
            CONTRADICTION,
        ],
    ),
    Alteration(
        "preempted-run-failed",
        _set("preempted", "run", "classification", "failed"),
        lambda p: [
            "preempt: the preempted run did not exit 3 as preempted (classification 'failed', "
            "exit 3)",
            CONTRADICTION,
        ],
    ),
    Alteration(
        "receipt-of-another-step",
        _set("preempted", "receipt", "step", 2),
        lambda p: [
            "preempt: the receipt names the checkpoint of step 2, not the step 3 the "
            "preemption came after",
            _receipt_mismatch("checkpoint used", _pre(p)["checkpoint_used"], _pre(p)["receipt"]),
            _receipt_mismatch(
                "resumed run's restored checkpoint",
                _pre(p)["resumed"]["restored"],
                _pre(p)["receipt"],
            ),
            CONTRADICTION,
        ],
    ),
    Alteration(
        "preempt-step-not-a-step",
        _set("settings", "preempt_after_step", None),
        lambda p: [
            "preempt: the receipt names the checkpoint of step 3, not the step None the "
            "preemption came after",
            CONTRADICTION,
        ],
    ),
    Alteration(
        "preempt-checkpoint-used-of-another-path",
        _set("preempted", "checkpoint_used", "path", "/elsewhere/step-00000003"),
        lambda p: [
            _receipt_mismatch(
                "checkpoint used",
                {**_pre(p)["checkpoint_used"], "path": "/elsewhere/step-00000003"},
                _pre(p)["receipt"],
            ),
            CONTRADICTION,
        ],
    ),
    Alteration(
        "preempt-checkpoint-used-of-another-step",
        _set("preempted", "checkpoint_used", "step", 2),
        lambda p: [
            _receipt_mismatch("checkpoint used", _pre(p)["checkpoint_used"], _pre(p)["receipt"]),
            _restored_not_used(
                "preempt",
                3,
                2,
                _pre(p)["checkpoint_used"]["sha256"],
                _pre(p)["checkpoint_used"]["sha256"],
            ),
            CONTRADICTION,
        ],
    ),
    Alteration(
        "preempt-restored-another-checkpoint",
        _set("preempted", "resumed", "restored", "sha256", "6" * 64),
        lambda p: [
            _receipt_mismatch(
                "resumed run's restored checkpoint",
                {**_pre(p)["resumed"]["restored"], "sha256": "6" * 64},
                _pre(p)["receipt"],
            ),
            _restored_not_used("preempt", 3, 3, "6" * 64, _pre(p)["checkpoint_used"]["sha256"]),
            CONTRADICTION,
        ],
    ),
    Alteration(
        "receipt-without-sha256",
        _set("preempted", "receipt", "sha256", None),
        lambda p: [
            _receipt_mismatch(
                "checkpoint used",
                _pre(p)["checkpoint_used"],
                {**_pre(p)["receipt"], "sha256": None},
            ),
            _receipt_mismatch(
                "resumed run's restored checkpoint",
                _pre(p)["resumed"]["restored"],
                {**_pre(p)["receipt"], "sha256": None},
            ),
            CONTRADICTION,
        ],
    ),
    Alteration(
        "preempt-checkpoint-not-verified",
        _set("preempted", "checkpoint_used", "verified", False),
        lambda p: ["preempt: the checkpoint used is not recorded as verified", CONTRADICTION],
    ),
    Alteration(
        "preempt-restored-state-hash-differs",
        _set("preempted", "resumed", "restored", "state_hash", "7" * 64),
        lambda p: [
            f"preempt: the restored state hash {'7' * 64} differs from the reference's at "
            f"step 3 ({ref(p, 3)})",
            CONTRADICTION,
        ],
    ),
    Alteration(
        "preempt-resumed-run-restored-nothing",
        _set("preempted", "resumed", "restored", {}),
        lambda p: [
            _receipt_mismatch(
                "resumed run's restored checkpoint",
                {"path": None, "sha256": None},
                _pre(p)["receipt"],
            ),
            "preempt: the resumed run records no restored checkpoint",
            CONTRADICTION,
        ],
    ),
    Alteration(
        "preempt-comparison-omits-a-step",
        _drop_row("preempted", "comparison", 5),
        lambda p: ["preempt: the recorded comparison omits step(s) 5", CONTRADICTION],
    ),
    Alteration(
        "preempt-no-comparison",
        _set("preempted", "comparison", None),
        lambda p: ["preempt: the proof records no comparison", CONTRADICTION],
    ),
    Alteration(
        "preempt-divergence-recorded",
        _set("preempted", "first_divergence", {"step": 5}),
        lambda p: ["preempt: the proof records a divergence: {'step': 5}", CONTRADICTION],
    ),
    Alteration(
        "preempt-section-not-passed",
        _set("preempted", "passed", "true"),
        lambda p: ["preempt: the section does not say it passed ('true')", CONTRADICTION],
    ),
    # -- state hashes of two versions (state.arrays.STATE_HASH_VERSION) ----------------
    Alteration(
        "crash-resumed-run-of-another-hash-version",
        _set("resumed", "state_hash_version", 2),
        lambda p: [_version_mix("crash", p, resumed=2), CONTRADICTION],
    ),
    Alteration(
        "preempt-restored-checkpoint-of-another-hash-version",
        _set("preempted", "resumed", "restored", "state_hash_version", 2),
        lambda p: [_version_mix("preempt", p, restored=2), CONTRADICTION],
    ),
    # -- the document's own claim --------------------------------------------------------
    Alteration(
        "passed-false",
        _set("passed", False),
        lambda p: [f"the proof does not say it passed (passed=False): {p['diagnosis']}"],
    ),
    Alteration(
        "passed-a-string",
        _set("passed", "true"),
        lambda p: [f"the proof does not say it passed (passed='true'): {p['diagnosis']}"],
    ),
]


@pytest.mark.parametrize("case", ALTERATIONS, ids=[c.name for c in ALTERATIONS])
def test_verdict_refuses_a_proof_with_one_thing_wrong(case):
    _check(stored_proof(), case)


def _check(proof: dict, case: Alteration) -> None:
    assert verdicts.verdict(proof, proof["computation_digest"]) == []
    altered = copy.deepcopy(proof)
    case.alter(altered)
    assert altered != proof, f"{case.name}: the alteration changed nothing"
    assert verdicts.verdict(altered, proof["computation_digest"]) == case.expected(proof), case.name


@pytest.mark.slow
def test_this_sessions_demo_proof_is_refused_with_each_alteration(linear_demo_run):
    """The same table on the proof the demo pipeline wrote in this session (same settings
    as the stored proof: six steps, the fault and the preemption after update 3)."""
    (proof_path,) = linear_demo_run.glob("results/computations/*/qualification/proof.json")
    proof = json.loads(proof_path.read_text())
    assert proof["preempted"]["receipt"]["path"] != stored_proof()["preempted"]["receipt"]["path"]
    for case in ALTERATIONS:
        _check(proof, case)


NOT_AN_OBJECT = "the proof is not a JSON object (it is a list)"


def test_verdict_refuses_what_is_not_an_object():
    assert verdicts.verdict([stored_proof()], stored_proof()["computation_digest"]) == [
        NOT_AN_OBJECT
    ]


def test_every_refusal_reason_has_an_alteration():
    """Each piece of text a reason can hold (the verdict's message templates, read from its
    source) is in the expected reasons of some alteration above: a new refusal branch
    without a test is seen here."""
    proof = stored_proof()
    expected = "\n".join([NOT_AN_OBJECT] + [r for c in ALTERATIONS for r in c.expected(proof)])
    for function in (
        verdicts.verdict,
        verdicts._crash_reasons,
        verdicts._preempt_reasons,
        verdicts._resumed_reasons,
        verdicts._version_mix,
    ):
        for piece in _message_pieces(function):
            assert piece in expected, f"{function.__name__}: no alteration expects {piece!r}"


def _message_pieces(function) -> set[str]:
    """The literal text of the strings in ``function`` that hold a space (messages, not
    field names), docstrings left out."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(function)))
    docstrings = {
        id(node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
    }
    return {
        node.value.strip()
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant)
        and isinstance(node.value, str)
        and " " in node.value.strip()
        and id(node) not in docstrings
    }


def test_paths_are_compared_as_paths():
    """The receipt's checkpoint and the restored one may be written differently (``a/./b``)."""
    proof = stored_proof()
    section = proof["preempted"]
    section["checkpoint_used"]["path"] = section["checkpoint_used"]["path"].replace(
        "/checkpoints/", "/./checkpoints/"
    )
    section["resumed"]["restored"]["path"] += "/"
    assert verdicts.verdict(proof, proof["computation_digest"]) == []


def test_legacy_proof_is_judged_as_crash_only():
    legacy = json.loads((PROOF.parent / "linear-demo-crash-legacy.json").read_text())
    assert "preempted" not in legacy and "mode" not in legacy["settings"]
    assert verdicts.verdict(legacy, legacy["computation_digest"]) == []
    legacy["settings"]["mode"] = "both"
    assert verdicts.verdict(legacy, legacy["computation_digest"]) == [
        "preempt: the proof's mode includes a preemption, but it has no preempted section",
        CONTRADICTION,
    ]
    crash_only = stored_proof()
    crash_only["settings"]["mode"] = "crash"
    crash_only["preempted"] = None  # a crash-only proof has no preemption to judge
    assert verdicts.verdict(crash_only, crash_only["computation_digest"]) == []
    preempt_only = stored_proof()
    preempt_only["settings"]["mode"] = "preempt"
    for field in ("faulted", "checkpoint_used", "resumed", "comparison"):
        preempt_only[field] = None
    assert verdicts.verdict(preempt_only, preempt_only["computation_digest"]) == []


def _crash_resumed_from(proof: dict, start: int) -> dict:
    """``proof`` with its crash part resumed, consistently, from a checkpoint of ``start``:
    the checkpoint used and the one restored agree, and the resumed run and the comparison
    hold the reference's hashes after it (the verdict judges records, not how they came)."""
    proof = copy.deepcopy(proof)
    rows, steps = proof["reference"]["state_hashes"], proof["settings"]["steps"]
    hashes = {r["step"]: r["state_hash"] for r in rows}
    sha = "c" * 64
    proof["checkpoint_used"] |= {"step": start, "sha256": sha}
    proof["resumed"]["restored"] |= {"step": start, "sha256": sha, "state_hash": hashes.get(start)}
    proof["resumed"]["state_hashes"] = [r for r in rows if r["step"] > start]
    proof["comparison"] = [
        {"step": s, "what": "update", "reference": hashes[s], "resumed": hashes[s], "equal": True}
        for s in range(max(start, 1), steps + 1)
    ]
    return proof


def test_boundaries_of_the_restored_step():
    """Step 0 (the initial state) is a step, with no reference hash to compare; from step 1
    on, the restored state is compared; the checkpoint may be of the fault's own step."""
    proof = stored_proof()
    digest = proof["computation_digest"]
    assert verdicts.verdict(_crash_resumed_from(proof, 0), digest) == []
    from_one = _crash_resumed_from(proof, 1)
    assert verdicts.verdict(from_one, digest) == []
    from_one["resumed"]["restored"]["state_hash"] = "8" * 64
    assert verdicts.verdict(from_one, digest) == [
        f"crash: the restored state hash {'8' * 64} differs from the reference's at step 1 "
        f"({ref(proof, 1)})",
        CONTRADICTION,
    ]
    at_the_fault = _crash_resumed_from(proof, 3)
    assert verdicts.verdict(at_the_fault, digest) == []


def test_records_past_the_proofs_steps_are_not_judged():
    proof = stored_proof()
    proof["resumed"]["state_hashes"].append({"step": 7, "state_hash": "9" * 64})
    proof["preempted"]["resumed"]["state_hashes"].append({"step": 7, "state_hash": "9" * 64})
    assert verdicts.verdict(proof, proof["computation_digest"]) == []


@pytest.mark.parametrize(
    "mode, field, value, reason",
    [
        (
            "crash",
            ("faulted", "classification"),
            "preempted",
            "crash: the faulted run is not the injected crash after update 3 (classification "
            "'preempted', last update 3)",
        ),
        (
            "preempt",
            ("preempted", "run", "exit_code"),
            1,
            "preempt: the preempted run did not exit 3 as preempted (classification "
            "'preempted', exit 1)",
        ),
    ],
)
def test_a_one_part_proof_is_judged_on_its_part(mode, field, value, reason):
    proof = stored_proof()
    proof["settings"]["mode"] = mode
    _set(*field, value)(proof)
    assert verdicts.verdict(proof, proof["computation_digest"]) == [reason, CONTRADICTION]
