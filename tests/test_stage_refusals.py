"""A pipeline stage's refusal of bad input: one line and exit 2, never a traceback; the
recovery proof's refusal names the worker's own failure (a reward that raised)."""

from __future__ import annotations

import pytest

from minifield.data.formats import DataError
from minifield.pipeline import errors, training


def test_a_refusal_is_one_line_on_stderr_and_exit_2(capsys):
    with pytest.raises(SystemExit) as ended, errors.refusals("prepare"):
        raise DataError("data/x.jsonl:3: 'response' is empty\n(nothing to train on)")
    assert ended.value.code == 2
    err = capsys.readouterr().err
    assert (
        err
        == "minifield refused (prepare): data/x.jsonl:3: 'response' is empty; (nothing to train on)\n"
    )


def test_anything_else_keeps_its_traceback():
    with pytest.raises(KeyError), errors.refusals("prepare"):
        raise KeyError("a bug")


def test_the_run_log_gives_each_refusal_once(tmp_path):
    log = tmp_path / "run.log"
    line = "minifield refused (hash_inputs): inputs[0]: sha256 differs"
    log.write_text(f"Logfile logs/a.log:\n{line}\nother\n{line}\n")
    assert errors.refusal_lines([log, tmp_path / "absent.log"]) == [line]


def _run(error=None) -> dict:
    return {"status": "failed" if error else "completed", "error": error}


def test_the_proof_names_the_reference_workers_reward_failure():
    message = "RewardError: reward 'score' (rewards/score.py): the function raised ValueError: x"
    proof = {"reference": _run({"phase": "train", "message": message})}
    assert training.worker_failure(proof) == (
        f"the reference run's worker failed (train): {message}"
    )


def test_the_faulted_and_preempted_runs_fail_by_design():
    proof = {
        "reference": _run(),
        "faulted": _run({"phase": "train", "message": "injected fault after update 2"}),
        "resumed": _run(),
        "preempted": {"run": _run({"phase": "preempted", "message": "SIGTERM"}), "resumed": _run()},
    }
    assert training.worker_failure(proof) is None
